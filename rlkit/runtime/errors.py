"""Exceptions raised in the controller when something goes wrong on the workers."""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RELAUNCH_HINT = "relaunch with rlkit.launch(...)"


@dataclass(frozen=True)
class RankFailure:
    """One rank's exception, as text (the exception object itself stays on the worker).

    ``memory`` is set when the rank ran out of memory: its memory report at that moment (see
    ``WorkerContext.set_memory_report``); ``out_of_memory`` says whether it did.
    """

    rank: int
    host: str
    device: str
    exc_type: str
    message: str
    traceback: str
    memory: str | None = None

    @classmethod
    def from_info(cls, rank: int, host: str, device: str, info: dict[str, str]) -> RankFailure:
        """From a worker's error info ("type", "message", "traceback", "memory" if it ran out)."""
        return cls(rank, host, device, info["type"], info["message"], info["traceback"], info.get("memory"))

    @property
    def out_of_memory(self) -> bool:
        return self.memory is not None

    def headline(self, call: str = "") -> str:
        where = f"rank {self.rank} (host {self.host}, device {self.device})"
        if self.out_of_memory:
            return f"{where} ran out of memory in {call or 'the call'}: {self.exc_type}: {self.message}"
        return f"{where} raised {self.exc_type}: {self.message}"


def decode_reply(rank: int, host: str, device: str, ok: bool, reply: Any, load: Callable[[Any], Any]) -> Any:
    """A worker's reply as the controller keeps it: ``load(reply)`` (the result), or a ``RankFailure``."""
    if not ok:
        return RankFailure.from_info(rank, host, device, reply)
    try:
        return load(reply)
    except Exception as exc:  # noqa: BLE001 - reported as this rank's failure
        return RankFailure(rank, host, device, type(exc).__name__,
                           f"its result cannot be loaded in the controller: {exc}", traceback.format_exc())


class RemoteError(RuntimeError):
    """One or more ranks raised; ``failures`` holds every rank's error, in rank order, and ``call``
    names the function that was running.

    The message names every failed rank and shows the first rank's remote traceback in full.
    """

    def __init__(self, failures: list[RankFailure], note: str = "", call: str = "") -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.call = call
        first = self.failures[0]
        lines = [first.headline(call)]
        lines += [f"also {f.headline(call)}" for f in self.failures[1:]]
        for f in self.failures:
            if f.out_of_memory:
                lines += ["", f"Memory of rank {f.rank} when it ran out:", (f.memory or "").rstrip()]
        if note:
            lines.append(note)
        lines += ["", f"Remote traceback (rank {first.rank}):", first.traceback.rstrip()]
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]


class WorkerOutOfMemory(RemoteError):
    """A ``RemoteError`` where at least one rank ran out of memory (CUDA, or host memory).

    The message says which rank ran out of memory in which function (``call``), and shows each such
    rank's memory report; ``out_of_memory`` lists those ranks' failures (``failure.memory`` is the
    report's text). Catch it before ``RemoteError`` to react to memory specifically.
    """

    @property
    def out_of_memory(self) -> list[RankFailure]:
        return [f for f in self.failures if f.out_of_memory]


def remote_error(failures: list[RankFailure], call: str, note: str = "") -> RemoteError:
    """The error for a call where ``failures`` happened: ``WorkerOutOfMemory`` if a rank ran out of
    memory, else ``RemoteError``."""
    cls = WorkerOutOfMemory if any(f.out_of_memory for f in failures) else RemoteError
    return cls(failures, note=note, call=call)


class WorkerDied(RuntimeError):
    """A worker process exited (crash, kill, out-of-memory) while the controller needed it."""

    def __init__(self, rank: int, pid: int, exit_code: int | None, *, during: str,
                 cause: str = "", log_path: str = "", log_tail: str = "",
                 cluster_broken: bool = True) -> None:
        self.rank, self.pid, self.exit_code = rank, pid, exit_code
        lines = [f"rank {rank} (pid {pid}) died during {during}: {cause or describe_exit(exit_code)}."]
        if log_tail:
            lines += [f"Last lines of {log_path}:", log_tail.rstrip()]
        elif log_path:
            lines.append(f"Its output is in {log_path}.")
        if cluster_broken:
            lines.append(f"The cluster is broken: {RELAUNCH_HINT}")
        super().__init__("\n".join(lines))


class WorkerHung(TimeoutError):
    """Ranks still running a call past a timeout (``Cluster.hang_timeout`` or ``call_timeout``).

    ``stacks`` maps each hung rank to its Python stacks at detection time ('' if it did not answer);
    ``cluster_broken`` says whether the cluster had to be shut down (ranks that could not be
    cancelled, typically blocked in a collective) or is still usable.
    """

    def __init__(self, ranks: list[int], reason: str, stacks: dict[int, str], *,
                 cluster_broken: bool, log_dir: str = "") -> None:
        self.ranks, self.stacks, self.cluster_broken = ranks, stacks, cluster_broken
        lines = [f"ranks {ranks} hung: {reason}."]
        if cluster_broken:
            lines.append(f"They could not be cancelled, so the cluster was shut down: {RELAUNCH_HINT}")
        else:
            lines.append("The call was cancelled on every rank; the cluster is still usable.")
        if log_dir:
            lines.append(f"Worker logs: {log_dir}")
        for rank in ranks:
            stack = stacks.get(rank) or "(no stack: the rank did not answer)"
            lines += ["", f"Stacks of rank {rank}:", stack.rstrip()]
        super().__init__("\n".join(lines))


class CollectiveAbandoned(RuntimeError):
    """Raised on a rank whose call failed where the other ranks wait, or will wait, in a collective it will not
    enter (inside an FSDP forward or backward): the controller ends the call at once rather than
    ``hang_timeout`` seconds later. The other ranks' stacks are taken and they are cancelled; blocked inside the
    collective they cannot be, and the cluster is shut down (:meth:`rlkit.runtime.Cluster.restart` starts fresh
    workers)."""


class ClusterBroken(RuntimeError):
    """The cluster cannot take calls any more (a worker died, a call was interrupted, or it was shut down)."""


class RolesReplaced(RuntimeError):
    """A call through a :class:`rlkit.runtime.RoleGroup` whose roles another owner's replaced on the cluster."""


def describe_exit(code: int | None) -> str:
    """Human-readable form of a ``Popen.returncode`` (negative: killed by that signal)."""
    if code is None:
        return "it closed its control connection"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (often the out-of-memory killer)" if -code == signal.SIGKILL else ""
    return f"killed by {name} ({-code}){hint}"
