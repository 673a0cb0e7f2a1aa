"""What a rollout engine leaves outside its worker dies with the worker, however the worker dies.

vLLM runs its engine in processes of its own (``VLLM::EngineCore``, ``VLLM::Worker``) and maps shared memory
under /dev/shm; the worker writes the actor's weights into a scratch folder there. A worker that exits
normally closes the engine (:meth:`rlkit.rollout.vllm.VLLMEngine.close`); one that is killed (its parent-death
signal when the kernel dies, the cluster's kill of its process group, the out-of-memory killer) cannot, and
the engine's processes would keep running, holding the weights, the KV cache and, on GPU, their share of the
device. So each engine gets a :class:`Reaper`: a small process (this file run as a script: the standard
library and psutil, no torch) in a session of its own, so that a kill of the worker's process group does not
reach it. It reads the worker's instructions from a pipe; the pipe's end comes when the worker exits, however
it exits, and then, unless the worker released it first, it kills the processes and deletes the paths it was
given, and exits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable

import psutil

EXIT_WAIT_S = 10.0
"""How long the reaper waits for the killed processes to be gone before it deletes their shared memory."""


class Reaper:
    """The watchdog of one engine: tell it what to remove if this process dies (:meth:`watch`), and
    :meth:`release` it once the engine was closed normally."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", __file__],  # isolated: not this folder's modules on sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # never the worker's output pipes: they must close when the worker does
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    def watch(self, processes: Iterable[psutil.Process] = (), paths: Iterable[str | os.PathLike] = ()) -> None:
        """Add ``processes`` (killed) and ``paths`` (files or folders, deleted) to what goes when this process dies."""
        known = [[p.pid, p.create_time()] for p in processes]
        self._send({"processes": known, "paths": [str(path) for path in paths]})

    def release(self) -> None:
        """The engine is closed: the reaper exits without removing anything."""
        if self._process.poll() is None:
            self._send("release")
            assert self._process.stdin is not None
            self._process.stdin.close()
            self._process.wait(timeout=EXIT_WAIT_S)

    def _send(self, message: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message).encode() + b"\n")
        self._process.stdin.flush()


def reap(processes: list[list[float]], paths: list[str]) -> None:
    """Kill the ``processes`` ([pid, create time]) that still run (not another process that reuses a pid), wait for
    them, then delete ``paths``."""
    alive = []
    for pid, created in processes:
        try:
            process = psutil.Process(int(pid))
            if abs(process.create_time() - created) < 1e-3:
                process.kill()
                alive.append(process)
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=EXIT_WAIT_S)
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)


def main() -> None:
    """The reaper: gather instructions until the pipe ends; then reap, unless released."""
    processes: list[list[float]] = []
    paths: list[str] = []
    for line in sys.stdin.buffer:
        message = json.loads(line)
        if message == "release":
            return
        processes += message["processes"]
        paths += message["paths"]
    reap(processes, paths)


if __name__ == "__main__":
    main()
