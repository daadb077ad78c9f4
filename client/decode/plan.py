"""The per-step plan and the cache sizing: facts computed once, read by every layer."""

from __future__ import annotations

import math

import torch

from kvdrive_client.decode.state import Context, StepPlan


def valid_from_mask(ctx: Context, mask: torch.Tensor | None, length: int) -> torch.Tensor:
    """``[B, length]`` real tokens, from the model's attention mask (None: all real)."""
    if mask is None:
        return torch.ones(ctx.batch, length, dtype=torch.bool, device=ctx.device)
    row = mask[:, 0, -1, :length]
    return row if row.dtype == torch.bool else row == 0


def first_local_page(ctx: Context, num_tokens: int, num_pages: int) -> int:
    """The first page of the local window (the last ``local_tokens`` tokens, from a page boundary on)."""
    return max(0, min(num_pages, (num_tokens - ctx.cfg.local_tokens) // ctx.cfg.page_size))


def cache_capacity(ctx: Context, layer: int, first_local: int) -> tuple[int, tuple[int, ...] | None]:
    """Slots per (row, KV head) for a context of ``first_local`` pages, and per-head limits (or None).

    Never more than the ``first_local`` pages a step can attend from the cache (sink and
    selectable): a multiple of a selection that is already every page would only reserve
    slots no page can fill (x4 the KV at budget 1)."""
    cfg, sh = ctx.cfg, ctx.shape
    sink = min(cfg.sink_pages, first_local)
    k = cfg.pages_to_select(first_local - sink)
    most = max(1, first_local)
    if cfg.head_multipliers is not None:
        per_head = tuple(min(most, max(math.ceil(w * k) + sink, k + sink, 1)) for w in cfg.head_multipliers[layer])
        return max(per_head), per_head
    if cfg.cache_bytes is not None:
        per_page = sh.page_bytes(cfg.page_size)
        slots = cfg.cache_bytes // (per_page * ctx.batch * sh.num_kv_heads * sh.num_layers)
        return min(most, max(int(slots), k + sink, 1)), None
    if ctx.multiplier == 0:
        return max(1, k + sink), None
    return min(most, max(1, math.ceil(ctx.multiplier * k) + sink)), None


def build_plan(ctx: Context, valid: torch.Tensor, t: int, num_pages: int, micro_batch: int,
               previous: StepPlan | None = None) -> StepPlan:
    """The plan of decode step ``ctx.step`` over ``t`` tokens of which ``num_pages`` pages are complete.

    The selectable and sink pages are the ``previous`` step's while the pages and the local
    window's start are (most steps: they move once a page): they follow from which
    tokens of the complete pages are real, which no later step changes."""
    first_local = first_local_page(ctx, t, num_pages)
    sink = min(ctx.cfg.sink_pages, first_local)
    k = ctx.cfg.pages_to_select(first_local - sink)
    size = ctx.batch if ctx.observers else min(micro_batch, ctx.batch)  # observers see whole batches
    groups = [(lo, min(lo + size, ctx.batch)) for lo in range(0, ctx.batch, size)]
    if previous is not None and (previous.num_pages, previous.first_local, previous.k) == (num_pages, first_local, k):
        selectable, sinks = previous.selectable, previous.sink_pages
    else:
        selectable, sinks = ctx.kernels.step_pages(valid, ctx.first_page, num_pages, sink, first_local,
                                                   ctx.cfg.page_size, selectable=k > 0)
    return StepPlan(ctx.step, valid, t, num_pages, first_local, sink, k, selectable, groups, sinks)
