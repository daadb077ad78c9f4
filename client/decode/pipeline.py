"""One layer's decode step over its micro-batches: stage after stage, or overlapped.

Overlapped, a front thread selects and places micro-batch i+1 while the daemon serves
i's fetch and the main thread attends for the oldest micro-batch whose selection is
done. The main thread submits a fetch as soon as a selection is ready and attends
whenever the next one is not; two fetches are in flight at most (two staging
buffers). The store client's socket is used by the main thread only.
"""

from __future__ import annotations

import queue
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from kvdrive_client.decode import attention, select
from kvdrive_client.decode.fetch import StoreIO
from kvdrive_client.decode.state import Context, MicroBatch, StepPlan


def micro_batches(ctx: Context, plan: StepPlan, query: torch.Tensor, lane: str) -> list[MicroBatch]:
    return [MicroBatch(i, lo, hi, query if (lo, hi) == (0, len(query)) else query[lo:hi], lane)
            for i, (lo, hi) in enumerate(plan.groups)]


def _front(ctx: Context, plan: StepPlan, layer: int, mb: MicroBatch) -> MicroBatch:
    select.choose(ctx, plan, layer, mb)
    select.place(ctx, plan, layer, mb)
    return mb


class Pipeline:
    """Runs the stages for one layer's micro-batches; owns the front thread."""

    def __init__(self, ctx: Context, io: StoreIO) -> None:
        self.ctx, self.io = ctx, io
        self._pool: ThreadPoolExecutor | None = None

    def run(self, plan: StepPlan, layer: int, query: torch.Tensor) -> list[torch.Tensor]:
        """Attention outputs of the step's micro-batches, in order."""
        ctx = self.ctx
        overlap = ctx.cfg.pipeline and len(plan.groups) > 1 and plan.attends_pages
        mbs = micro_batches(ctx, plan, query, "front" if overlap else "main")
        if not plan.attends_pages:
            return [attention.finish(ctx, self.io, plan, layer, mb) for mb in mbs]
        if not overlap:
            return [self._serial(plan, layer, mb) for mb in mbs]
        return self._overlapped(plan, layer, mbs)

    def _serial(self, plan: StepPlan, layer: int, mb: MicroBatch) -> torch.Tensor:
        _front(self.ctx, plan, layer, mb)
        select.to_host(self.ctx, self.io, mb)
        mb.fetch = self.io.submit(layer, mb.lo, mb.host, slot=0)
        return attention.finish(self.ctx, self.io, plan, layer, mb)

    def _front_thread(self, plan: StepPlan, layer: int, mbs: list[MicroBatch], ready: queue.Queue) -> None:
        try:
            # Grad mode is per thread; selection and cache bookkeeping never need gradients.
            with torch.no_grad():
                for mb in mbs:
                    ready.put(_front(self.ctx, plan, layer, mb))
        except BaseException as exc:  # handed to the main thread, which raises it
            ready.put(exc)

    def _overlapped(self, plan: StepPlan, layer: int, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        if self._pool is None:
            # One intra-op thread for the front's torch ops: the main thread's attention and
            # the model's own layers already use the cores; two pools would oversubscribe them.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvdrive-front",
                                            initializer=torch.set_num_threads, initargs=(1,))
        ready: queue.Queue = queue.Queue()
        done = self._pool.submit(self._front_thread, plan, layer, mbs, ready)
        outs: list[torch.Tensor | None] = [None] * len(mbs)
        inflight: deque[MicroBatch] = deque()
        submitted = 0

        def submit_ready(block: bool) -> None:
            # Submit every selection the front thread has finished (two fetches in flight at most).
            nonlocal submitted
            while submitted < len(mbs) and len(inflight) < 2:
                try:
                    mb = ready.get() if block and not inflight else ready.get_nowait()
                except queue.Empty:
                    return
                if isinstance(mb, BaseException):
                    raise mb
                select.to_host(self.ctx, self.io, mb)
                mb.fetch = self.io.submit(layer, mb.lo, mb.host, slot=submitted % 2)
                inflight.append(mb)
                submitted += 1

        try:
            while submitted < len(mbs) or inflight:
                submit_ready(block=True)
                mb = inflight.popleft()
                # A selection that finished meanwhile is fetched while this micro-batch attends.
                outs[mb.index] = attention.finish(self.ctx, self.io, plan, layer, mb,
                                                  landed=lambda: submit_ready(block=False))
        finally:
            done.result()
        return outs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
