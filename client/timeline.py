"""A per-step timeline of decode stages, written as Chrome trace JSON.

Each stage of each micro-batch is one complete event (``"ph": "X"``) on the lane
that ran it: ``select`` and ``hit/miss`` on the front thread, ``fetch`` on the
daemon (from the get's submission for as long as the daemon reports it worked on
it), ``fill`` and ``compute`` on the main thread. Open the file in Perfetto
(ui.perfetto.dev) or chrome://tracing to see which stages overlap.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

LANES = {"front": 1, "daemon": 2, "main": 3}


class Timeline:
    """Events of one session; a disabled timeline (no ``trace=`` asked for) records nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, stage: str, lane: str, start: float, end: float, **args) -> None:
        """One stage from ``start`` to ``end`` (``time.perf_counter()`` seconds)."""
        if not self.enabled:
            return
        event = {"name": stage, "cat": "decode", "ph": "X", "pid": 1, "tid": LANES[lane],
                 "ts": round((start - self._t0) * 1e6, 1), "dur": round(max(end - start, 0.0) * 1e6, 1), "args": args}
        with self._lock:
            self._events.append(event)

    def mark(self, name: str, at: float, **args) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._events.append({"name": name, "ph": "i", "s": "g", "pid": 1, "tid": LANES["main"],
                                 "ts": round((at - self._t0) * 1e6, 1), "args": args})

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def to_chrome(self) -> dict:
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "KVDrive decode"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}} for lane, tid in LANES.items()]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_chrome()))
        tmp.replace(path)
        return path
