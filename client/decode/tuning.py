"""Warm-up calibration of the micro-batch size and the cache multiplier; logs what it chose.

Micro-batch: after one warm-up step, each candidate size (the batch, its half, its
quarter, one row) runs one step, twice round; the fastest (by its faster step) is
kept. Cache multiplier (``cache_multiplier=None``): starts at 1x and grows by half while a
step's fetching takes longer than its hit/miss evaluation, for at most a few steps
(the paper's rule).
"""

from __future__ import annotations

import logging
from collections import Counter

from kvdrive_client.decode.state import Context

log = logging.getLogger("kvdrive_client.session")

START_MULTIPLIER = 1.0
MAX_MULTIPLIER = 16.0
MULTIPLIER_STEPS = 8
ROUNDS = 2


class Tuning:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        cfg, batch = ctx.cfg, ctx.batch
        self.micro_batch = cfg.micro_batch or batch
        self.calibration: str | None = None  # what the micro-batch calibration chose, once it has
        self.tune_multiplier = cfg.cache_multiplier is None
        sizes = sorted({batch, -(-batch // 2), -(-batch // 4), 1}, reverse=True)
        self.candidates = sizes if cfg.micro_batch is None and cfg.pipeline and batch > 1 else []
        self.timed: dict[int, list[float]] = {}
        self._last = Counter()

    def after_step(self, step: int, step_ms: float) -> None:
        if self.candidates:
            self._micro_batch(step, step_ms)
        if self.tune_multiplier:
            self._multiplier(step)

    def _micro_batch(self, step: int, step_ms: float) -> None:
        if step >= 1:
            self.timed.setdefault(self.micro_batch, []).append(step_ms)
        todo = [c for c in self.candidates if len(self.timed.get(c, ())) < ROUNDS]
        if todo:
            self.micro_batch = min(todo, key=lambda c: (len(self.timed.get(c, ())), self.candidates.index(c)))
            return
        best = {c: min(v) for c, v in self.timed.items()}
        self.micro_batch = min(best, key=best.get)
        self.calibration = (f"micro-batch {self.micro_batch} of {self.ctx.batch} rows (step ms by size: "
                            + ", ".join(f"{c}: {ms:.1f}" for c, ms in sorted(best.items())) + ")")
        log.info("calibrated %s", self.calibration)
        self.candidates = []

    def _multiplier(self, step: int) -> None:
        ctx = self.ctx
        fetch = ctx.stats["fetch_ms"] - self._last["fetch_ms"]
        hitmiss = ctx.stats["hitmiss_ms"] - self._last["hitmiss_ms"]
        self._last = Counter({"fetch_ms": ctx.stats["fetch_ms"], "hitmiss_ms": ctx.stats["hitmiss_ms"]})
        if step + 1 >= MULTIPLIER_STEPS or fetch <= hitmiss or ctx.multiplier >= MAX_MULTIPLIER:
            log.info("calibrated cache multiplier: x%g (last step: fetch %.1f ms, hit/miss %.1f ms)", ctx.multiplier,
                     fetch, hitmiss)
            self.tune_multiplier = False
        else:
            ctx.multiplier = min(MAX_MULTIPLIER, ctx.multiplier * 1.5)
