"""Stages 1 and 2 of a decode step: choose the pages, place them in the device cache."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvdrive.kernels import reference as ref
from kvdrive_client.decode.fetch import StoreIO
from kvdrive_client.decode.state import Context, MicroBatch, StepPlan
from kvdrive_client.device_cache import EvictionPolicy


def choose(ctx: Context, plan: StepPlan, layer: int, mb: MicroBatch) -> None:
    """Stage 1: the pages each (row, head) of the micro-batch attends (sink pages, then the
    ``k`` best selectable ones), and the cached pages' current scores for lookahead eviction."""
    t0 = time.perf_counter()
    ls = ctx.layers[layer]
    whole = mb.rows == ctx.batch
    selector = ls.selector if whole else ls.selector.rows(mb.lo, mb.hi)
    cached = ls.cache.slot_page[mb.lo : mb.hi]
    lookahead = ctx.cfg.eviction is EvictionPolicy.LOOKAHEAD and ls.cache.reuse
    chosen = plan.sink_pages[mb.lo : mb.hi, None, :].expand(mb.rows, ctx.shape.num_kv_heads, plan.sink)
    slot_scores = None
    if plan.k:
        picked, scores, slot_scores = selector.select_and_score(mb.query, plan.selectable[mb.lo : mb.hi], plan.k,
                                                                cached if lookahead else None)
        # A row with fewer selectable pages than k (padding) gets -1: nothing there.
        picked = picked.masked_fill(scores == ref.NEG_INF, -1)
        if ctx.observers:
            t_ob = time.perf_counter()
            for ob in ctx.observers:
                ob.on_select(layer, plan.step, mb.query, picked, plan.selectable, ls.selector)
            t0 += time.perf_counter() - t_ob  # measurement is not selection time
        chosen = torch.cat([chosen, picked], dim=2)
    if lookahead and slot_scores is None:
        slot_scores = selector.page_scores(mb.query, cached)
    mb.chosen, mb.slot_scores = chosen, slot_scores
    t1 = time.perf_counter()
    ctx.timeline.add("select", mb.lane, t0, t1, layer=layer, mb=mb.index)
    mb.select_ms = (t1 - t0) * 1e3


def place(ctx: Context, plan: StepPlan, layer: int, mb: MicroBatch) -> None:
    """Stage 2: hit/miss evaluation; the cache's bookkeeping for the micro-batch's rows."""
    t0 = time.perf_counter()
    cache = ctx.layers[layer].cache
    mb.cache = cache if mb.rows == ctx.batch else cache.rows(mb.lo, mb.hi)
    mb.placement = mb.cache.place(mb.chosen, plan.step, mb.slot_scores, num_pages=plan.num_pages)
    t1 = time.perf_counter()
    ctx.timeline.add("hit/miss", mb.lane, t0, t1, layer=layer, mb=mb.index)
    mb.place_ms = (t1 - t0) * 1e3


def to_host(ctx: Context, io: StoreIO, mb: MicroBatch) -> None:
    """Copy the placement to the host (what the fetch reads) on the main thread, in one copy
    with the figures counted on the device and the decode pages ready for the store; put
    those pages; add the micro-batch's hits, misses and stage times to the session's figures."""
    counts, pages = ctx.counts.take(), io.take_pages()
    extra = ([] if counts is None else [counts.view(torch.uint8)]) + ([] if pages is None else [pages[1]])
    mb.host, tail = mb.placement.to_host(torch.cat(extra) if extra else None)
    if counts is not None:
        n = counts.numel() * counts.element_size()
        ctx.counts.add_to(ctx.stats, tail[:n].view(np.int64))
        tail = tail[n:]
    if pages:
        io.put_pages(pages[0], tail)
    ctx.stats["hits"] += mb.host.num_hits
    ctx.stats["misses"] += mb.host.num_misses
    ctx.stats["select_ms"] += mb.select_ms
    ctx.stats["hitmiss_ms"] += mb.place_ms
