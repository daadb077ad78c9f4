"""Stages 1 and 2 of a decode step: choose the pages, place them in the device cache."""

from __future__ import annotations

import time

import numpy as np
import torch

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
    cached = mb.of(ls.cache.slot_page)
    lookahead = ctx.cfg.eviction is EvictionPolicy.LOOKAHEAD and ls.cache.reuse
    sink, slot_scores = mb.of(plan.sink_pages), None
    if not plan.k:
        chosen = sink[:, None, :].expand(mb.rows, ctx.shape.num_kv_heads, plan.sink)
    else:
        # A row with fewer selectable pages than k (padding) gets -1: nothing there; so do
        # its picks past its own k (best first: the ones kept are its own top k).
        chosen, slot_scores = selector.choose(mb.query, mb.of(plan.selectable), plan.k, sink,
                                              cached if lookahead else None)
        if plan.beyond is not None:
            chosen[:, :, plan.sink :].masked_fill_(mb.of(plan.beyond)[:, None, :], -1)
        if ctx.observers:
            t_ob = time.perf_counter()
            for ob in ctx.observers:
                ob.on_select(layer, plan.step, mb.query, chosen[:, :, plan.sink :], plan.selectable, ls.selector)
            t0 += time.perf_counter() - t_ob  # measurement is not selection time
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
    words = ([] if counts is None else [counts]) + ([] if pages is None else [pages[1]])
    mb.host, tail = mb.placement.to_host(None if not words else words[0] if len(words) == 1 else torch.cat(words))
    if counts is not None:
        ctx.counts.add_to(ctx.stats, tail[: counts.numel()])
        tail = tail[counts.numel() :]
    if pages:
        io.put_pages(pages[0], tail.view(np.uint8)[: pages[2]])
    ctx.stats["hits"] += mb.host.num_hits
    ctx.stats["misses"] += mb.host.num_misses
    ctx.stats["select_ms"] += mb.select_ms
    ctx.stats["hitmiss_ms"] += mb.place_ms

