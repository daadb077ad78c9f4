"""Stages 3 and 4 of a decode step: land the fetched pages, attend exactly.

Attention covers the sink and selected pages (straight from their cache slots) and
the local window. Where the kernels attend in parts (the CPU's), the cached pages
and the local window are attended while the misses are fetched, and the fetched
pages after they land, the two parts merged through their log-sum-exps.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from kvdrive_client.decode.fetch import StoreIO
from kvdrive_client.decode.state import Context, MicroBatch, StepPlan


def attended_valid(ctx: Context, plan: StepPlan, layer: int, mb: MicroBatch):
    """Which of the micro-batch's attended tokens (selected pages, then local window) are real,
    in the form the kernels' attention reads (a bool tensor, or the Triton kernels' record)."""
    ls = ctx.layers[layer]
    return ctx.kernels.attended_valid(mb.of(plan.valid), mb.chosen, ctx.cfg.page_size, ls.window.start,
                                      plan.t, ctx.shape.num_kv_heads)


def land(ctx: Context, io: StoreIO, layer: int, mb: MicroBatch) -> None:
    """Stage 3 on the main thread: wait for the fetched pages and write them into the cache."""
    if mb.fetch is None:
        return
    kv = io.wait(mb.fetch, mb.index)
    t0 = time.perf_counter()
    mb.cache.fill_kv(mb.placement, kv, mb.host)
    t1 = time.perf_counter()
    ctx.timeline.add("fill", "main", t0, t1, layer=layer, mb=mb.index)
    ctx.stats["fetch_ms"] += (t1 - t0) * 1e3


def _attend(ctx: Context, layer: int, mb: MicroBatch, slots: torch.Tensor | None, partial, local: bool = True):
    """Stage 4 over ``slots`` (None: no pages) and, with ``local``, the local window."""
    t0 = time.perf_counter()
    ls, sh = ctx.layers[layer], ctx.shape
    window = mb.window(ls.window) if local else None
    cache_k, cache_v = (mb.cache.k, mb.cache.v) if slots is not None else (None, None)
    out = ctx.kernels.attend_window(mb.query, cache_k, cache_v, slots, window, mb.valid, sh.scaling, partial)
    t1 = time.perf_counter()
    ctx.timeline.add("compute", "main", t0, t1, layer=layer, mb=mb.index)
    ctx.stats["attention_ms"] += (t1 - t0) * 1e3
    return out


def finish(ctx: Context, io: StoreIO, plan: StepPlan, layer: int, mb: MicroBatch,
           landed: Callable[[], None] | None = None) -> torch.Tensor:
    """Stages 3 and 4 for one micro-batch: ``[rows, H, G, D]`` attention output in the query's dtype.

    ``landed`` runs once the fetched pages are in the cache (the pipeline submits the
    next fetch there: it reuses this fetch's staging buffer).
    """
    mb.valid = attended_valid(ctx, plan, layer, mb)
    # The step's context is counted once, at its first layer: every layer attends the same tokens.
    context = (mb.of(plan.valid), plan.t, ctx.shape.num_kv_heads * ctx.shape.num_layers) if layer == 0 else None
    ctx.counts.add_attended(ctx.kernels, mb.valid, context)
    if mb.chosen is None:
        out = _attend(ctx, layer, mb, None, None)
    elif mb.fetch is not None and ctx.cfg.overlap_fetch and ctx.kernels.attends_in_parts:
        partial, miss = ctx.kernels.partial(), mb.placement.miss
        _attend(ctx, layer, mb, mb.placement.slots.masked_fill(miss, -1), partial)
        land(ctx, io, layer, mb)
        if landed is not None:
            landed()
        out = _attend(ctx, layer, mb, mb.placement.slots.masked_fill(~miss, -1), partial, local=False)
    else:
        land(ctx, io, layer, mb)
        if landed is not None:
            landed()
        out = _attend(ctx, layer, mb, mb.placement.slots, None)
    return out.to(mb.query.dtype)
