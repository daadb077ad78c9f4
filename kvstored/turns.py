"""Work served in turn by owner: a user first, then a session of that user.

The writer thread takes puts, creates and deletes from a :class:`FairQueue` rather
than first come, first served: one user after another, and within a user one session
after another, each taking one item a turn. A user with many requests queued, on
however many connections or sessions, delays another user's by at most one of its
own per turn. :class:`Turns` is the bookkeeping, O(1) a push or a pop; the queue adds
the lock and the wait.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Hashable


class Turns:
    """Items queued per (user, session), popped user by user and, within a user, session by
    session. Dictionaries keep insertion order, so the one at the front is the one whose
    turn it is, and one that still has items goes to the back after its turn."""

    def __init__(self) -> None:
        self._users: dict[Hashable, dict[Hashable, deque]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, user: Hashable, session: Hashable, item: Any) -> None:
        self._users.setdefault(user, {}).setdefault(session, deque()).append(item)
        self._len += 1

    def pop(self) -> Any:
        """The next item of the user whose turn it is (IndexError when empty)."""
        if not self._users:
            raise IndexError("pop from empty Turns")
        user = next(iter(self._users))
        sessions = self._users.pop(user)
        session = next(iter(sessions))
        items = sessions.pop(session)
        item = items.popleft()
        if items:
            sessions[session] = items
        if sessions:
            self._users[user] = sessions
        self._len -= 1
        return item


class FairQueue:
    """A thread-safe :class:`Turns` with ``queue.Queue``'s ``get`` and ``get_nowait``."""

    def __init__(self) -> None:
        self._turns = Turns()
        self._ready = threading.Condition()

    def put(self, user: Hashable, session: Hashable, item: Any) -> None:
        with self._ready:
            self._turns.push(user, session, item)
            self._ready.notify()

    def get(self, timeout: float | None = None) -> Any:
        """The next item in turn, waiting up to ``timeout`` seconds (forever for None);
        ``queue.Empty`` if none came."""
        with self._ready:
            if not self._ready.wait_for(lambda: len(self._turns) > 0, timeout):
                raise queue.Empty
            return self._turns.pop()

    def get_nowait(self) -> Any:
        with self._ready:
            if not self._turns:
                raise queue.Empty
            return self._turns.pop()

    def __len__(self) -> int:
        with self._ready:
            return len(self._turns)
