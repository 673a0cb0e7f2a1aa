"""Messages through torchrun's key-value store: the channel of the torchrun backend.

torchrun hosts a ``TCPStore`` (its rendezvous store) that every rank reaches at MASTER_ADDR:MASTER_PORT.
The torchrun backend keeps its keys under a prefix of its own (the run id and restart count), so it
never touches torchrun's. A message is a list of byte strings, its "parts" (a pickle, then the raw bytes
of each tensor buffer), each written in chunks of at most ``CHUNK_BYTES`` (torch's libuv store refuses
values over 8 MiB), then a header key naming the chunk counts, written last: a reader that finds the
header finds every chunk. Each store connection serialises its requests, so every thread that blocks
on the store opens its own (:func:`connect`).

torchrun's store listens on every interface and takes anyone's writes, so every message is signed: its
header carries an HMAC-SHA256 of the key, the chunk counts and every part under a secret the ranks share
and the store never sees (:func:`secret`), and a reader checks it before it unpickles anything. A message
that fails the check is refused (logged, deleted) and the reader waits for the real one at the same key.

Keys, per rank ``r``:
    in/r/<seq>       controller -> rank r's main loop: ("init", config), ("call", call_id, data, buffer keys),
                     ("shutdown",)
    arg/<call>/<i>   a call's tensor buffers, each written once whatever the number of ranks reading it
    ctl/r/<seq>      controller -> rank r's control thread: ("cancel", call_id), ("stacks",)
    ready/r          rank r joined the process group: ("ready", info) or ("failed", error info)
    out/r/<call>     rank r's result: pickle((ok, data or error info)), then the result's tensor buffers
    done/<call>      a counter: how many ranks have written their result of the call
    beat/r           "unix_time rss_mb" every HEARTBEAT_S
    stacks/r         rank r's Python stacks, when asked
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import math
import os
import pickle
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**20
"""Largest value written under one key (torch's libuv TCPStore refuses values over 8 MiB)."""
STORE_TIMEOUT = timedelta(days=7)
"""How long a blocking store request waits: a rank waits for its next call as long as the run lasts."""
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.02
"""Polling for a key starts every millisecond and backs off to this (``check`` is one request)."""
SECRET_VARIABLE = "RLKIT_TORCHRUN_SECRET"
"""The ranks' shared secret, when set (the same on every node: needed when ranks span several nodes)."""
TAG_BYTES = 32
"""A header starts with its HMAC-SHA256 tag; the chunk counts follow as JSON."""


class Unsigned(ValueError):
    """A message in the store without a valid signature: written by someone without the ranks' secret."""


@functools.cache
def secret() -> bytes:
    """The key that signs this run's messages: ``RLKIT_TORCHRUN_SECRET`` if set, else (every rank on this node) 32
    random bytes in a file of this run that only this user can read, made by whichever rank comes first.

    Raises:
        RuntimeError: ranks on several nodes and no ``RLKIT_TORCHRUN_SECRET``.
    """
    if os.environ.get(SECRET_VARIABLE):
        return os.environ[SECRET_VARIABLE].encode()
    if int(os.environ["WORLD_SIZE"]) != int(os.environ["LOCAL_WORLD_SIZE"]):
        raise RuntimeError(
            f"the ranks span several nodes: set {SECRET_VARIABLE} to the same secret on every node (e.g. export "
            f"{SECRET_VARIABLE}=$(openssl rand -hex 32) before starting torchrun) so that they can sign their "
            "messages; torchrun's store takes anyone's writes"
        )
    path = secret_file()
    if not path.exists():
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        draft.write_bytes(secrets.token_bytes(32))
        try:
            os.link(draft, path)  # atomic, and refused if another rank made it first
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_bytes()


def secret_file() -> Path:
    """Where the ranks of a one-node run keep their secret: a folder of this user's (mode 700) in the temp dir."""
    folder = Path(tempfile.gettempdir()) / f"rlkit-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    mode = folder.stat()
    if mode.st_uid != os.getuid() or mode.st_mode & 0o077:
        raise RuntimeError(f"{folder} is not this user's alone (owner {mode.st_uid}, mode {oct(mode.st_mode)})")
    run = f"{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return folder / f"torchrun-{run}.key"


def connect() -> dist.Store:
    """A new connection to torchrun's store, under this run's prefix (torchrun sets the variables read here)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT
    )
    run = f"{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"rlkit/{run}/", store)


def put(store: dist.Store, key: str, parts: Sequence[Any]) -> None:
    """Write ``parts`` (bytes-like objects) under ``key``: the chunks first, the signed header last."""
    counts = []
    views = [memoryview(part).cast("B") for part in parts]
    for j, view in enumerate(views):
        chunks = max(1, math.ceil(view.nbytes / CHUNK_BYTES))
        for i in range(chunks):
            _set(store, f"{key}/{j}/{i}", bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]))
        counts.append(chunks)
    listing = json.dumps(counts).encode()
    _set(store, key, _tag(key, listing, views) + listing)


def _tag(key: str, listing: bytes, parts: Sequence[Any]) -> bytes:
    """HMAC-SHA256 of the key, the chunk counts and every part (each after its length), under :func:`secret`."""
    mac = hmac.new(secret(), digestmod=hashlib.sha256)
    for field in (key.encode(), listing, *parts):
        mac.update(len(field).to_bytes(8, "little"))
        mac.update(field)
    return mac.digest()


def _set(store: dist.Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # torch's stub says str; its binding takes bytes too


def put_object(store: dist.Store, key: str, obj: Any) -> None:
    """Write one picklable object (no tensors) under ``key``."""
    put(store, key, [pickle.dumps(obj)])


def get(store: dist.Store, key: str, *, delete: bool) -> list[bytes]:
    """The parts written under ``key`` (blocking until a signed message is there); with ``delete``, remove them.
    A message with no valid signature is logged, deleted and waited past."""
    while True:
        try:
            counts, parts = _read_signed(store, key)
        except Unsigned as exc:
            logger.warning("refused a message in torchrun's store under %r: %s; waiting for a signed one", key, exc)
            _delete(store, key, _counts(store.get(key)) if store.check([key]) else [])
            continue
        if delete:
            _delete(store, key, counts)
        return parts


def _read_signed(store: dist.Store, key: str) -> tuple[list[int], list[bytes]]:
    """(chunk counts, parts) of the message under ``key``; Unsigned unless its tag is right."""
    header = store.get(key)
    tag, listing = header[:TAG_BYTES], header[TAG_BYTES:]
    counts = _counts(header)
    chunks = [[f"{key}/{j}/{i}" for i in range(n)] for j, n in enumerate(counts)]
    if not store.check([k for part in chunks for k in part]):  # a signed header comes after its chunks
        raise Unsigned("its header names chunks that are not there")
    parts = [b"".join(store.get(k) for k in part) for part in chunks]
    if not hmac.compare_digest(tag, _tag(key, listing, parts)):
        raise Unsigned("its signature does not match (not written by a rank of this run)")
    return counts, parts


def _counts(header: bytes) -> list[int]:
    """The chunk counts a header names ([] when it names none readably: a forgery)."""
    try:
        counts = json.loads(header[TAG_BYTES:])
    except ValueError:
        return []
    ok = isinstance(counts, list) and all(isinstance(n, int) and 0 < n < 2**20 for n in counts)
    return counts if ok else []


def get_object(store: dist.Store, key: str, *, delete: bool) -> Any:
    return pickle.loads(get(store, key, delete=delete)[0])


def remove(store: dist.Store, key: str) -> None:
    """Delete what :func:`put` wrote under ``key``, if it is there."""
    if store.check([key]):
        _delete(store, key, _counts(store.get(key)))


def _delete(store: dist.Store, key: str, counts: list[int]) -> None:
    store.delete_key(key)
    for j, n in enumerate(counts):
        for i in range(n):
            store.delete_key(f"{key}/{j}/{i}")


def poll(check: Callable[[], bool], timeout: float) -> bool:
    """Call ``check`` until it returns True (then True) or ``timeout`` seconds pass (then False), backing
    off from ``POLL_FIRST_S`` to ``POLL_MAX_S`` between calls."""
    deadline = time.monotonic() + timeout
    pause = POLL_FIRST_S
    while not check():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, POLL_MAX_S)
    return True
