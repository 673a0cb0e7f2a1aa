"""The Ray backend's worker side: ``RayWorker`` (a ``WorkerCore`` as a Ray actor) and ``Mailbox``.

Ray runs a plain actor's methods on its process's main thread, so ``WorkerCore`` runs calls and
cancels them exactly as in a local worker process. The actor cannot take a second method call
while one runs, so a control thread in each actor talks to a small ``Mailbox`` actor every
``BEAT_S`` seconds: it delivers heartbeats and new output lines, and picks up "cancel" and
"stacks" requests left there by the controller.

Output: the actor's stdout and stderr (file descriptors 1 and 2, so C++ output too) go to a file
on its node, ``<tmp>/rlkit-<cluster id>/rank<N>.out``, which survives a crash; the control thread
and the end of each call send the new lines on to the controller, which prefixes, rate-limits and
logs them like the local backend's.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import ray
import torch

from rlkit.runtime import transport
from rlkit.runtime.core import WorkerCore, error_info, mark_output_end, rss_mb
from rlkit.runtime.worker import configure_logging

logger = logging.getLogger(__name__)

BEAT_S = 0.25


class Mailbox:
    """Heartbeats, output lines and stacks from the workers; commands for them (a Ray actor)."""

    def __init__(self, world_size: int) -> None:
        self._beats: dict[int, tuple[float, float]] = {}
        self._lines: dict[int, list[str]] = {r: [] for r in range(world_size)}
        self._commands: dict[int, list[tuple]] = {r: [] for r in range(world_size)}
        self._stacks: dict[int, str] = {}

    def beat(self, rank: int, when: float, rss: float, lines: list[str],
             stacks: str | None) -> list[tuple]:
        """A worker's heartbeat; returns (and forgets) the commands waiting for it."""
        self._beats[rank] = (when, rss)
        self._lines[rank] += lines
        if stacks is not None:
            self._stacks[rank] = stacks
        commands, self._commands[rank] = self._commands[rank], []
        return commands

    def command(self, ranks: list[int], command: tuple) -> None:
        for rank in ranks:
            self._commands[rank].append(command)

    def collect(self) -> tuple[dict[int, tuple[float, float]], dict[int, list[str]], dict[int, str]]:
        """Latest heartbeats; output lines and stacks since the last collect (then forgotten)."""
        lines = {r: v for r, v in self._lines.items() if v}
        self._lines = {r: [] for r in self._lines}
        stacks, self._stacks = self._stacks, {}
        return dict(self._beats), lines, stacks


class _OutputFile:
    """This process's stdout/stderr, redirected into a file; ``new_lines`` reads what was added."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self._reader = open(path, "rb")  # noqa: SIM115 - kept open for the process's life
        self._partial = b""
        self._lock = threading.Lock()

    def new_lines(self) -> list[str]:
        """Complete lines written since the last call (from any thread)."""
        with self._lock:
            data = self._partial + self._reader.read()
            *lines, self._partial = data.split(b"\n")
        return [line.decode("utf-8", "replace") + "\n" for line in lines]


class RayWorker:
    """One rank as a Ray actor: ``RayBackend`` creates it with ``ray.remote(RayWorker)``."""

    def __init__(self, rank: int, cluster_id: str, mailbox: Any) -> None:
        out_dir = os.path.join(tempfile.gettempdir(), f"rlkit-{cluster_id}")
        os.makedirs(out_dir, exist_ok=True)
        self._output = _OutputFile(os.path.join(out_dir, f"rank{rank}.out"))
        configure_logging(rank)
        self.rank = rank
        self.core = WorkerCore(rank)
        self._mailbox = mailbox
        self._stacks: str | None = None
        # Held while lines are on their way to the mailbox, so that the lines a call returns
        # never overtake earlier ones.
        self._send_lock = threading.Lock()
        threading.Thread(target=self._control, name="rlkit-control", daemon=True).start()

    def info(self) -> dict[str, Any]:
        """Where this actor runs; "ip" is the address its Ray node advertises."""
        node = ray.get_runtime_context().get_node_id()
        ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
        return {"pid": os.getpid(), "host": socket.gethostname(), "ip": ip, "node": node,
                "log": self._output.path, "cuda_devices": torch.cuda.device_count()}

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def join(self, config: dict[str, Any]) -> tuple[bool, Any]:
        """Join the process group: ``(True, device)`` or ``(False, error info)``."""
        try:
            return True, str(self.core.join(config).device)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
            return False, error_info(exc)

    def call(self, call_id: int, data: bytes, refs: list[Any]) -> tuple[bool, Any, list[str]]:
        """Run one call: ``(ok, (pickle, buffers) or error info, output lines)``."""
        ok, reply = self.core.execute(call_id, lambda: transport.loads(data, ray.get(refs)),
                                      transport.OutOfBand().dumps)
        mark_output_end(call_id)
        with self._send_lock:
            return ok, reply, self._output.new_lines()

    def _control(self) -> None:
        """Heartbeats, output and commands through the mailbox, until the process ends."""
        while True:
            stacks, self._stacks = self._stacks, None
            try:
                with self._send_lock:
                    commands = ray.get(self._mailbox.beat.remote(
                        self.rank, time.time(), rss_mb(), self._output.new_lines(), stacks))
            except Exception:  # noqa: BLE001 - the mailbox is gone: the cluster is shutting down
                return
            for command in commands:
                if command[0] == "cancel":
                    self.core.cancel(command[1])
                elif command[0] == "stacks":
                    self._stacks = self.core.stacks()
            time.sleep(0 if self._stacks is not None else BEAT_S)
