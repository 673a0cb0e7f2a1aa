"""The server's queued requests: futures by request id (kept until collected or expired), the first answer of each
idempotent request, and the per-model ``seq_id`` order of Tinker's calls."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")

KEEP_DELIVERED_S = 60.0
"""How long a result stays after its first delivery, for a client whose answer was lost on the way to poll again."""
KEEP_UNCOLLECTED_S = 600.0
"""How long a finished result nobody collected stays before it expires (its client is gone)."""
KEEP_IDEMPOTENT_S = 600.0
"""How long the first answer of a request with an ``X-Idempotency-Key`` is replayed to its retries."""


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, body, content type."""

    status: int
    body: bytes
    content_type: str = "application/json"


class Linked(Future[T]):
    """A future that follows another (``source``): it cancels only if its source does, i.e. before that started."""

    def __init__(self, source: Future[Any] | None = None):
        super().__init__()
        self.source = source

    def cancel(self) -> bool:
        if self.source is not None and not self.source.cancel():
            return False
        return super().cancel()


def then(future: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """A future of ``fn(future.result())`` (its exception when either raises); cancelling it cancels ``future``,
    and fails while ``future`` runs."""
    out: Linked[U] = Linked(future)
    future.add_done_callback(lambda done: _settle(out, lambda: fn(done.result())))
    return out


def _settle(out: Future[U], value: Callable[[], U]) -> None:
    """``out`` gets ``value()``, its exception, or is cancelled with it; nothing when ``out`` is already done."""
    if out.done():
        return
    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
        try:
            result = value()
        except CancelledError:
            out.cancel()
        except Exception as exc:  # noqa: BLE001 - handed to the client as the request's failure
            out.set_exception(exc)
        else:
            out.set_result(result)


def failed(exc: BaseException) -> Future[Any]:
    out: Future[Any] = Future()
    out.set_exception(exc)
    return out


@dataclass
class _Pending:
    future: Future[Reply]
    done_at: float | None = None
    delivered_at: float | None = None


class PendingRequests:
    """Futures by the request id the client polls (``retrieve_future``). A result stays until ``keep_delivered_s``
    after its first delivery (a lost answer can be polled again), or ``keep_uncollected_s`` after it finished when
    nobody collects it; a request still running never expires."""

    def __init__(self, keep_delivered_s: float = KEEP_DELIVERED_S, keep_uncollected_s: float = KEEP_UNCOLLECTED_S,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self._lock = threading.Lock()
        self._entries: dict[str, _Pending] = {}
        self._ids = itertools.count(1)
        self._keep_delivered, self._keep_uncollected, self._clock = keep_delivered_s, keep_uncollected_s, clock

    def add(self, future: Future[Reply]) -> str:
        entry = _Pending(future)
        with self._lock:
            self._expire()
            request_id = f"req-{next(self._ids)}"
            self._entries[request_id] = entry
        future.add_done_callback(lambda _: setattr(entry, "done_at", self._clock()))
        return request_id

    def get(self, request_id: str) -> Future[Reply] | None:
        with self._lock:
            self._expire()
            entry = self._entries.get(request_id)
        return entry.future if entry is not None else None

    def delivered(self, request_id: str) -> None:
        """The result of ``request_id`` was answered; it expires ``keep_delivered_s`` after the first answer."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.delivered_at is None:
                entry.delivered_at = self._clock()

    def cancel_all(self) -> None:
        """Cancel every request that has not started (a running one finishes)."""
        with self._lock:
            futures = [e.future for e in self._entries.values()]
        for future in futures:
            future.cancel()

    def _expire(self) -> None:
        now = self._clock()
        gone = [rid for rid, e in self._entries.items()
                if (e.delivered_at is not None and now - e.delivered_at > self._keep_delivered)
                or (e.done_at is not None and now - e.done_at > self._keep_uncollected)]  # fmt: skip
        for request_id in gone:
            del self._entries[request_id]


@dataclass
class _Answered:
    reply: Future[Reply] = field(default_factory=Future)
    at: float = 0.0


class IdempotentReplies:
    """The first answer of each request carrying an ``X-Idempotency-Key`` (the SDK keeps the key across its
    retries), replayed to the retries for ``keep_s``: a retried ``optim_step`` gets the first one's request id
    instead of running twice. A server error (5xx) is not kept, so its retry runs again."""

    def __init__(self, keep_s: float = KEEP_IDEMPOTENT_S, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, str], _Answered] = {}
        self._keep, self._clock = keep_s, clock

    def answer(self, key: str, path: str, compute: Callable[[], Reply]) -> Reply:
        """``compute()``, or the answer of the first request with this key and path (waiting for it if it runs)."""
        with self._lock:
            now = self._clock()
            for old in [k for k, a in self._answers.items() if now - a.at > self._keep]:
                del self._answers[old]
            first = self._answers.get((key, path))
            if first is None:
                mine = self._answers[(key, path)] = _Answered(at=now)
        if first is not None:
            return first.reply.result()
        try:
            reply = compute()
        except BaseException as exc:
            self._forget(key, path)
            mine.reply.set_exception(exc)
            raise
        if reply.status >= 500:
            self._forget(key, path)
        mine.reply.set_result(reply)
        return reply

    def _forget(self, key: str, path: str) -> None:
        with self._lock:
            self._answers.pop((key, path), None)


class SeqOrder:
    """Starts one model's calls in ``seq_id`` order (1, 2, ...), whatever order they arrive in: the SDK may send
    a later chunk before an earlier one. A refused call still takes its turn, so no later call waits for it; a
    call cancelled before its turn is skipped in its turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._waiting: dict[int, tuple[Callable[[], Future[Reply]], Linked[Reply]]] = {}

    def submit(self, seq_id: int, start: Callable[[], Future[Reply]]) -> Future[Reply]:
        """``start()``'s future, once every smaller ``seq_id`` has started."""
        proxy: Linked[Reply] = Linked()
        with self._lock:
            if seq_id < self._next or seq_id in self._waiting:
                return failed(ValueError(f"seq_id={seq_id} was already used: each call needs a new one"))
            self._waiting[seq_id] = (start, proxy)
            while self._next in self._waiting:  # start in order, under the lock, so the queue sees that order
                ready_start, ready_proxy = self._waiting.pop(self._next)
                self._next += 1
                _start_into(ready_start, ready_proxy)
        return proxy


def _start_into(start: Callable[[], Future[Reply]], proxy: Linked[Reply]) -> None:
    if proxy.cancelled():
        return
    try:
        future = start()
    except Exception as exc:  # noqa: BLE001 - a refused call (bad data, ...) fails its request
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            proxy.set_exception(exc)
        return
    proxy.source = future
    future.add_done_callback(lambda done: _settle(proxy, done.result))


class Refused(ValueError):
    """A request refused with an HTTP status other than 400 (404 unknown, 409 conflict, 410 gone, 413 too large)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
