"""Exceptions raised in the controller when something goes wrong on the workers."""

from __future__ import annotations

import signal
from dataclasses import dataclass

RELAUNCH_HINT = "relaunch with rlkit.launch(...)"


@dataclass(frozen=True)
class RankFailure:
    """One rank's exception, as text (the exception object itself stays on the worker)."""

    rank: int
    host: str
    device: str
    exc_type: str
    message: str
    traceback: str

    def headline(self) -> str:
        return (f"rank {self.rank} (host {self.host}, device {self.device}) raised "
                f"{self.exc_type}: {self.message}")


class RemoteError(RuntimeError):
    """One or more ranks raised; ``failures`` holds every rank's error, in rank order.

    The message names every failed rank and shows the first rank's remote traceback in full.
    """

    def __init__(self, failures: list[RankFailure], note: str = "") -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        first = self.failures[0]
        lines = [first.headline()]
        lines += [f"also {f.headline()}" for f in self.failures[1:]]
        if note:
            lines.append(note)
        lines += ["", f"Remote traceback (rank {first.rank}):", first.traceback.rstrip()]
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]


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


class ClusterBroken(RuntimeError):
    """The cluster cannot take calls any more (a worker died, a call was interrupted, or it was shut down)."""


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
