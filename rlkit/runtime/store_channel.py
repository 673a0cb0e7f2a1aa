"""Messages through torchrun's key-value store: the channel of the torchrun backend.

torchrun hosts a ``TCPStore`` (its rendezvous store) that every rank reaches at MASTER_ADDR:MASTER_PORT.
The torchrun backend keeps its keys under a prefix of its own (the run id and restart count), so it
never touches torchrun's. A message is a list of byte strings, its "parts" (a pickle, then the raw bytes
of each tensor buffer), each written in chunks of at most ``CHUNK_BYTES`` (torch's libuv store refuses
values over 8 MiB), then a header key naming the chunk counts, written last: a reader that finds the
header finds every chunk. Each store connection serialises its requests, so every thread that blocks
on the store opens its own (:func:`connect`).

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

import math
import os
import pickle
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

CHUNK_BYTES = 4 * 2**20
"""Largest value written under one key (torch's libuv TCPStore refuses values over 8 MiB)."""
STORE_TIMEOUT = timedelta(days=7)
"""How long a blocking store request waits: a rank waits for its next call as long as the run lasts."""
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.02
"""Polling for a key starts every millisecond and backs off to this (``check`` is one request)."""


def connect() -> dist.Store:
    """A new connection to torchrun's store, under this run's prefix (torchrun sets the variables read here)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT
    )
    run = f"{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"rlkit/{run}/", store)


def put(store: dist.Store, key: str, parts: Sequence[Any]) -> None:
    """Write ``parts`` (bytes-like objects) under ``key``: the chunks first, the header last."""
    counts = []
    for j, part in enumerate(parts):
        view = memoryview(part).cast("B")
        chunks = max(1, math.ceil(view.nbytes / CHUNK_BYTES))
        for i in range(chunks):
            _set(store, f"{key}/{j}/{i}", bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]))
        counts.append(chunks)
    _set(store, key, pickle.dumps(counts))


def _set(store: dist.Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # torch's stub says str; its binding takes bytes too


def put_object(store: dist.Store, key: str, obj: Any) -> None:
    """Write one picklable object (no tensors) under ``key``."""
    put(store, key, [pickle.dumps(obj)])


def get(store: dist.Store, key: str, *, delete: bool) -> list[bytes]:
    """The parts written under ``key`` (blocking until its header exists); with ``delete``, remove them."""
    counts = pickle.loads(store.get(key))
    parts = [b"".join(store.get(f"{key}/{j}/{i}") for i in range(n)) for j, n in enumerate(counts)]
    if delete:
        _delete(store, key, counts)
    return parts


def get_object(store: dist.Store, key: str, *, delete: bool) -> Any:
    return pickle.loads(get(store, key, delete=delete)[0])


def remove(store: dist.Store, key: str) -> None:
    """Delete what :func:`put` wrote under ``key``, if it is there."""
    if store.check([key]):
        _delete(store, key, pickle.loads(store.get(key)))


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
