"""Worker output: each rank's stdout/stderr go to ``<log_dir>/rank<N>.log`` and, with a
``[rank N] `` prefix and a rate limit, to the controller's ``sys.stdout``. The lines come from the
worker's pipe, read by a thread (local backend), or are handed over by the backend (``feed``, Ray).
Unless ``verbose``, vLLM's own log lines below ERROR (its start-up banner and configuration, the weight
loader's per-sync messages), progress bars, rlkit's info notes and libraries' warnings (multiprocessing's
resource tracker at exit among them) stay in the log file only.

:class:`LogFolder` is a cluster's folder of those files: one that ``rlkit.launch`` made for itself is
removed at a clean shutdown and kept (and named) when something failed.

During a call the lines are queued and written by the caller's thread (``hold``/``flush``/
``release``), so notebook front-ends, which attribute output by thread, attach them to the running
cell; between calls the reader threads write them directly. After each call a worker writes
``DONE_MARKER`` + call id to its stdout, so ``release`` can wait until everything the call printed
has been forwarded before the call returns.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

DONE_MARKER = "\x00rlkit:done:"
_DONE_RE = re.compile(re.escape(DONE_MARKER) + r"(\d+)\n?")
QUIET_LINES = re.compile(
    r"^(\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \["  # vLLM's log format
    r"|^(DEBUG|INFO) rlkit[\w.]*: "  # rlkit's own progress notes on the worker (warnings still come through)
    r"|^(\[rank\d+\]:)?\[?[IW]\d{4} \d\d:\d\d:\d\d\.\d+"  # torch's glog-style lines ([rankN]: once distributed)
    r"|^\S*/(site-packages|lib/python3\.\d+)/\S+\.py:\d+: \w*Warning: "  # a library's Python warning
    r"|^\s*$"
)
"""Worker lines kept out of the cell or terminal (only in the rank's log) unless the cluster is verbose."""


@dataclass
class LogFolder:
    """Where a cluster's ``rank<N>.log`` files go. ``owned``: ``rlkit.launch`` made it (a temporary folder), so
    :meth:`close` removes it unless ``failed`` was set (a call failed, a rank died or hung): then it is kept."""

    path: Path
    owned: bool
    failed: bool = False

    def close(self) -> None:
        if not self.owned or not self.path.exists():
            return
        if self.failed:
            logger.warning("worker logs kept in %s (something failed)", self.path)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class _Stream:
    """One rank's output stream; mutable fields are guarded by the forwarder's lock."""

    rank: int
    log_path: Path
    thread: threading.Thread | None = None
    done_call: int = -1
    eof: bool = False
    window_start: float = field(default_factory=time.monotonic)
    forwarded: int = 0
    dropped: int = 0
    quieted: bool = False
    """The last line was kept quiet: an indented line after it (a warning's source line) is too."""


class OutputForwarder:
    """Reads each worker's output pipe in a thread, logs every line and forwards at most
    ``lines_per_s`` lines per second per rank (dropped lines are counted and reported)."""

    def __init__(self, lines_per_s: int = 50, verbose: bool = False) -> None:
        self.lines_per_s = lines_per_s
        self.verbose = verbose
        """Forward every line; False keeps the QUIET_LINES in the log file only."""
        self._cond = threading.Condition()
        self._streams: dict[int, _Stream] = {}
        self._held = False
        self._pending: list[str] = []

    def attach(self, rank: int, pipe: IO[bytes], log_path: Path) -> None:
        """Start forwarding ``pipe`` (the worker's merged stdout/stderr) for ``rank``."""
        stream = _Stream(rank, log_path)
        stream.thread = threading.Thread(target=self._read, args=(stream, pipe),
                                         name=f"rlkit-output-rank{rank}", daemon=True)
        self._streams[rank] = stream
        stream.thread.start()

    def hold(self) -> None:
        """Queue forwarded lines until ``release``; ``flush`` writes them from the caller's thread."""
        with self._cond:
            self._held = True

    def flush(self) -> None:
        """Write the queued lines."""
        with self._cond:
            self._write_pending()

    def release(self, call_id: int | None, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` s until every rank's output up to the end of call ``call_id`` has
        been read (skip with None), write everything queued and stop holding."""
        with self._cond:
            if call_id is not None:
                self._cond.wait_for(lambda: all(s.eof or s.done_call >= call_id
                                                for s in self._streams.values()), timeout)
            for stream in self._streams.values():
                self._report_dropped(stream)
            self._write_pending()
            self._held = False

    def wait_eof(self, rank: int, timeout: float) -> None:
        """Wait until ``rank``'s pipe is closed (its process and children are gone), at most ``timeout`` s."""
        with self._cond:
            self._cond.wait_for(lambda: self._streams[rank].eof, timeout)

    def join(self, timeout: float) -> None:
        """Wait for the reader threads to finish (their pipes closed), ``timeout`` s in all."""
        deadline = time.monotonic() + timeout
        for stream in self._streams.values():
            if stream.thread is not None:
                stream.thread.join(max(0.0, deadline - time.monotonic()))

    def _read(self, stream: _Stream, pipe: IO[bytes]) -> None:
        with pipe, open(stream.log_path, "a", encoding="utf-8") as log:
            for raw in iter(pipe.readline, b""):
                self._take(stream, raw.decode("utf-8", "replace"), log)
        self.close(stream.rank)

    def add(self, rank: int, log_path: Path) -> None:
        """Forward ``rank``'s output given to ``feed`` (no pipe to read)."""
        self._streams[rank] = _Stream(rank, log_path)

    def feed(self, rank: int, lines: list[str]) -> None:
        """Take lines (each ending in a newline) of ``rank``'s output."""
        stream = self._streams[rank]
        with open(stream.log_path, "a", encoding="utf-8") as log:
            for line in lines:
                self._take(stream, line, log)

    def close(self, rank: int) -> None:
        """``rank``'s output has ended (its process is gone)."""
        stream = self._streams[rank]
        with self._cond:
            self._report_dropped(stream)
            stream.eof = True
            self._cond.notify_all()

    def _take(self, stream: _Stream, line: str, log: IO[str]) -> None:
        """Log one line, forward it, and note the end-of-call marker it may carry."""
        done = _DONE_RE.findall(line)
        if done:
            line = _DONE_RE.sub("", line)
        if line and not line.endswith("\n"):
            line += "\n"
        if line:
            log.write(line)
            log.flush()
        with self._cond:
            if line and (self.verbose or not self._quiet(stream, line)):
                self._forward(stream, line)
            if done:
                stream.done_call = int(done[-1])
                self._cond.notify_all()

    @staticmethod
    def _quiet(stream: _Stream, line: str) -> bool:
        """Whether ``line`` stays in the log only: one of QUIET_LINES, a progress bar (redrawn with carriage
        returns), or the indented line after one of those."""
        quiet = "\r" in line or bool(QUIET_LINES.match(line))
        stream.quieted = quiet or (stream.quieted and line.startswith("  "))
        return stream.quieted

    def _forward(self, stream: _Stream, line: str) -> None:
        now = time.monotonic()
        if now - stream.window_start >= 1.0:
            self._report_dropped(stream)
            stream.window_start, stream.forwarded = now, 0
        if stream.forwarded < self.lines_per_s:
            stream.forwarded += 1
            self._emit(f"[rank {stream.rank}] {line}")
        else:
            stream.dropped += 1

    def _report_dropped(self, stream: _Stream) -> None:
        if stream.dropped:
            self._emit(f"[rank {stream.rank}] ... {stream.dropped} lines dropped, "
                       f"see {stream.log_path}\n")
            stream.dropped = 0

    def _emit(self, text: str) -> None:
        if self._held:
            self._pending.append(text)
        else:
            _write_stdout(text)

    def _write_pending(self) -> None:
        if self._pending:
            _write_stdout("".join(self._pending))
            self._pending.clear()


def _write_stdout(text: str) -> None:
    """Present worker output on the controller's current ``sys.stdout`` (this is not logging)."""
    out = sys.stdout
    if out is None:
        return
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):  # stdout closed or broken: the log file still has the lines
        pass


def tail(path: Path, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
