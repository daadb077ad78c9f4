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


def prompt_shift(prompt_tokens: int, page_size: int) -> int:
    """The padding tokens KVDrive puts before a prompt of ``prompt_tokens`` (the model's,
    padding included), so that it ends on a page boundary."""
    return -prompt_tokens % page_size


def pad_front(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` after ``n`` zero tokens (``x`` itself for none)."""
    return x if n == 0 else torch.cat([x.new_zeros(*x.shape[:2], n, x.shape[3]), x], dim=2)


def shifted(valid: torch.Tensor, shift: int) -> torch.Tensor:
    """The model's real tokens ``valid`` ``[B, T]`` after the session's ``shift`` padding tokens."""
    return valid if shift == 0 else torch.cat([valid.new_zeros(valid.shape[0], shift), valid], dim=1)


def row_pages_to_select(ctx: Context, first_local: int) -> list[int]:
    """Each row's ``k``: what it selects alone, from its own selectable pages (those after its
    sink, from its first real page on, before ``first_local``), not the padded batch's."""
    cfg = ctx.cfg
    out = []
    for first in ctx.first_pages:
        own = max(0, first_local - first)  # the row's pages before the local window, as alone
        out.append(cfg.pages_to_select(own - min(cfg.sink_pages, own)))
    return out


def first_local_page(ctx: Context, num_tokens: int, num_pages: int) -> int:
    """The first page of the local window (the last ``local_tokens`` tokens, from a page boundary on)."""
    return max(0, min(num_pages, (num_tokens - ctx.cfg.local_tokens) // ctx.cfg.page_size))


def cache_capacity(ctx: Context, layer: int, first_local: int) -> tuple[int, tuple[int, ...] | None]:
    """Slots per (row, KV head) for a context of ``first_local`` pages, and per-head limits (or None).

    Never more than the ``first_local`` pages a step can attend from the cache (sink and
    selectable): a multiple of a selection that is already every page would only reserve
    slots no page can fill (x4 the KV at budget 1). Sized for the longest row (its own ``k``
    and pages), as it would be alone; the shorter ones get the same."""
    cfg, sh = ctx.cfg, ctx.shape
    own = max(0, first_local - min(ctx.first_pages))
    sink = min(cfg.sink_pages, own)
    k = max(row_pages_to_select(ctx, first_local))
    most = max(1, own)
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
    tokens of the complete pages are real, which no later step changes.

    Each row selects its own ``k`` (:func:`row_pages_to_select`): the kernels take the
    largest, and a row's picks past its own ``k`` become -1 (``StepPlan.beyond``). Picks
    come best first, so the ones kept are the row's own top ``k``: as when it runs alone."""
    first_local = first_local_page(ctx, t, num_pages)
    sink = min(ctx.cfg.sink_pages, first_local)
    size = ctx.batch if ctx.observers else min(micro_batch, ctx.batch)  # observers see whole batches
    groups = [(lo, min(lo + size, ctx.batch)) for lo in range(0, ctx.batch, size)]
    if previous is not None and (previous.num_pages, previous.first_local) == (num_pages, first_local):
        k, beyond = previous.k, previous.beyond
        selectable, sinks = previous.selectable, previous.sink_pages
    else:
        rows_k = row_pages_to_select(ctx, first_local)
        k = max(rows_k, default=0)
        beyond = None
        if min(rows_k, default=k) < k:
            own = torch.tensor(rows_k, device=ctx.device)
            beyond = torch.arange(k, device=ctx.device)[None, :] >= own[:, None]
        selectable, sinks = ctx.kernels.step_pages(valid, ctx.first_page, num_pages, sink, first_local,
                                                   ctx.cfg.page_size, selectable=k > 0)
    return StepPlan(ctx.step, valid, t, num_pages, first_local, sink, k, selectable, groups, sinks, beyond)
