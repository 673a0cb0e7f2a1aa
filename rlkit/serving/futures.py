"""The server's queued requests: futures by request id, and the per-model ``seq_id`` order of Tinker's calls."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, body, content type."""

    status: int
    body: bytes
    content_type: str = "application/json"


def then(future: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """A future of ``fn(future.result())`` (its exception when either raises)."""
    out: Future[U] = Future()

    def relay(done: Future[T]) -> None:
        try:
            out.set_result(fn(done.result()))
        except Exception as exc:  # noqa: BLE001 - handed to the client as the request's failure
            out.set_exception(exc)

    future.add_done_callback(relay)
    return out


def failed(exc: BaseException) -> Future[Any]:
    out: Future[Any] = Future()
    out.set_exception(exc)
    return out


class PendingRequests:
    """Futures by the request id the client polls (``retrieve_future``); a result leaves once delivered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, Future[Reply]] = {}
        self._ids = itertools.count(1)

    def add(self, future: Future[Reply]) -> str:
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            self._futures[request_id] = future
        return request_id

    def get(self, request_id: str) -> Future[Reply] | None:
        with self._lock:
            return self._futures.get(request_id)

    def delivered(self, request_id: str) -> None:
        with self._lock:
            self._futures.pop(request_id, None)


class SeqOrder:
    """Starts one model's calls in ``seq_id`` order (1, 2, ...), whatever order they arrive in: the SDK may send
    a later chunk before an earlier one. A refused call still takes its turn, so no later call waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._waiting: dict[int, tuple[Callable[[], Future[Reply]], Future[Reply]]] = {}

    def submit(self, seq_id: int, start: Callable[[], Future[Reply]]) -> Future[Reply]:
        """``start()``'s future, once every smaller ``seq_id`` has started."""
        proxy: Future[Reply] = Future()
        with self._lock:
            if seq_id < self._next or seq_id in self._waiting:
                return failed(ValueError(f"seq_id={seq_id} was already used: each call needs a new one"))
            self._waiting[seq_id] = (start, proxy)
            while self._next in self._waiting:  # start in order, under the lock, so the queue sees that order
                ready_start, ready_proxy = self._waiting.pop(self._next)
                self._next += 1
                _start_into(ready_start, ready_proxy)
        return proxy


def _start_into(start: Callable[[], Future[Reply]], proxy: Future[Reply]) -> None:
    try:
        future = start()
    except Exception as exc:  # noqa: BLE001 - a refused call (bad data, ...) fails its request
        proxy.set_exception(exc)
        return

    def copy(done: Future[Reply]) -> None:
        exc = done.exception()
        if exc is not None:
            proxy.set_exception(exc)
        else:
            proxy.set_result(done.result())

    future.add_done_callback(copy)
