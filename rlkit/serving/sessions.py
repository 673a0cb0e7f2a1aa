"""The SDK's sessions on a Tinker server: created here with random ids, kept alive by heartbeats, ended by
``ServiceClient.close()`` (``sessions/<id>/finish``); the training client on the cluster belongs to one live
session at a time."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlkit.serving.futures import Refused

SESSION_TIMEOUT_S = 60.0
"""A session not heard from for this long (the SDK heartbeats every 10 s) no longer holds the training client."""


@dataclass
class _Session:
    seen: float
    finished: bool = False


class Sessions:
    """The sessions of one server, and which one owns the training client (see the module docstring)."""

    def __init__(self, timeout_s: float = SESSION_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._trainer: str | None = None
        self._timeout, self._clock = timeout_s, clock

    def create(self) -> str:
        """A new session; sessions ended or silent for ``timeout_s`` are forgotten (but the training client's)."""
        session_id = f"session-{secrets.token_hex(8)}"
        with self._lock:
            for old in [k for k, s in self._sessions.items() if k != self._trainer and not self._alive(s)]:
                del self._sessions[old]
            self._sessions[session_id] = _Session(self._clock())
        return session_id

    def heartbeat(self, session_id: str) -> None:
        """Keep ``session_id`` alive (Refused 404 when unknown, 410 when finished: the SDK stops its heartbeats)."""
        with self._lock:
            self._live(session_id).seen = self._clock()

    def finish(self, session_id: str) -> None:
        """End ``session_id`` (its training client may be taken over by another session)."""
        with self._lock:
            self._live(session_id).finished = True

    def claim_training(self, session_id: str) -> None:
        """Make ``session_id`` the owner of the training client; Refused 409 while another live session owns it."""
        with self._lock:
            session = self._live(session_id)
            session.seen = self._clock()
            owner = self._sessions.get(self._trainer) if self._trainer is not None else None
            if owner is not None and self._trainer != session_id and self._alive(owner):
                raise Refused(409, f"session {self._trainer} is training on this server (heard from "
                              f"{self._clock() - owner.seen:.0f} s ago): rlkit trains one client per cluster; end that "
                              "session (ServiceClient.close()) or wait until it has been silent for "
                              f"{self._timeout:.0f} s")  # fmt: skip
            self._trainer = session_id

    def _live(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise Refused(404, f"session_id={session_id!r}: no such session on this server (create_session first)")
        if session.finished:
            raise Refused(410, f"session {session_id} has finished (ServiceClient.close()); create a new one")
        return session

    def _alive(self, session: _Session) -> bool:
        return not session.finished and self._clock() - session.seen <= self._timeout
