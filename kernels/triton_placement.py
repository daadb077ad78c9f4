"""Device-cache placement, and landing fetched pages in their slots, in Triton kernels.

Placement has run on one H200 against the reference (``tests/kernels/test_triton_gpu.py``);
landing (:func:`land`) has not run on a GPU yet.

:func:`place` is :func:`kvdrive.kernels.reference.place` (same arguments, same results,
the maps updated in place the same way) in one launch instead of some fifty torch ops.
One program per (row, KV head): it looks the selected pages up, ranks the slots as
victims by sorting ``(priority, slot)`` keys (empty slots first, then by priority, ties
to the lower slot; slots of selected hits and past the head's window never), gives the
``j``-th miss the ``j``-th victim, and rewrites the three maps. Checked under Triton's
interpreter against the reference (``tests/kernels/test_placement.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvdrive.kernels.triton_kernels import _launch_lock, _pow2


@triton.jit
def _orderable(prio):
    """float32 -> int64 keys in the same order (-inf first, +inf last; -0.0 ties with 0.0)."""
    bits = tl.where(prio == 0, 0.0, prio).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


# Counts and the step change from call to call: not specialised on (no recompiling).
@dataclass
class PagePriority:
    """Each slot's victim priority as its cached page's score, ``scores`` ``[B, H, P]`` read by
    the placement kernel at the slot's page (``reference.gather_scores`` of the cached pages,
    without building it)."""

    scores: torch.Tensor


@triton.jit(do_not_specialize=["K", "C", "N", "NP", "step", "spr_b", "spr_h"])
def _place_kernel(
    pages_ptr, page_slot_ptr, slot_page_ptr, last_used_ptr, prio_ptr, cap_ptr, slots_ptr, miss_ptr,
    H, K, C, N, NP, step,
    spg_b, spg_h, sps_b, sps_h, ssp_b, ssp_h, slu_b, slu_h, spr_b, spr_h, sout_b, sout_h,
    HAS_CAP: tl.constexpr, BY_PAGE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (row x head): slots and misses of its ``K`` selected pages; its maps updated.
    ``prio`` is per slot, or with ``BY_PAGE`` per page (``NP`` of them)."""
    pair = tl.program_id(0)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    page = tl.load(pages_ptr + b * spg_b + h * spg_h + kk, mask=km, other=-1)
    none = page < 0
    page_slot = page_slot_ptr + b * sps_b + h * sps_h
    slot = tl.load(page_slot + tl.maximum(page, 0), mask=km & (page < N), other=-1)
    miss = (slot < 0) & ~none & km
    hit = ~miss & ~none & km
    slot = tl.where(none & (slot < 0), 0, slot)
    # Victim priority per slot: empty slots first, then by priority; hits and slots past the window never.
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    slot_page = slot_page_ptr + b * ssp_b + h * ssp_h
    cached = tl.load(slot_page + c, mask=cm, other=-1)
    if BY_PAGE:
        prio = tl.load(prio_ptr + b * spr_b + h * spr_h + tl.maximum(cached, 0), mask=cm & (cached < NP),
                       other=float("-inf")).to(tl.float32)
    else:
        prio = tl.load(prio_ptr + b * spr_b + h * spr_h + c, mask=cm, other=0).to(tl.float32)
    prio = tl.where(cached < 0, float("-inf"), prio)
    if HAS_CAP:
        prio = tl.where(c >= tl.load(cap_ptr + h), float("inf"), prio)
    # The hits' slots, marked in last_used (-1 - step: no step leaves it negative; every
    # marked slot is set to step below) rather than compared k x C in registers. The
    # priority (last_used itself for LRU) is read first.
    last_used = last_used_ptr + b * slu_b + h * slu_h
    tl.debug_barrier()
    tl.store(last_used + slot, -1 - step, mask=hit)
    tl.debug_barrier()
    kept = tl.load(last_used + c, mask=cm, other=0) < 0
    prio = tl.where(kept, float("inf"), prio)
    key = (_orderable(prio) << 32) | c.to(tl.int64)
    key = tl.where(cm, key, 0x7FFFFFFFFFFFFFFF)
    victims = (tl.sort(key) & 0xFFFFFFFF).to(tl.int64)
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    slot = tl.where(miss, tl.gather(victims, tl.maximum(rank, 0), 0), slot)
    old = tl.load(slot_page + slot, mask=miss, other=-1)
    tl.debug_barrier()  # every program's reads of its maps before its writes
    # Unmap the evicted pages, map the new ones (disjoint: a missed page was not cached).
    tl.store(page_slot + old, -1, mask=miss & (old >= 0))
    tl.store(page_slot + page, slot, mask=miss)
    tl.store(slot_page + slot, page, mask=~none & km)
    tl.store(last_used + slot, step, mask=~none & km)
    out = b * sout_b + h * sout_h + kk
    tl.store(slots_ptr + out, slot, mask=km)
    tl.store(miss_ptr + out, miss, mask=km)


def place(pages: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor, last_used: torch.Tensor,
          prio: torch.Tensor | PagePriority, head_capacity: torch.Tensor | None,
          step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvdrive.kernels.reference.place` in one Triton launch: (slots, miss), both ``[B, H, k]``.

    The maps (``page_slot`` ``[B, H, N]``, ``slot_page`` and ``last_used`` ``[B, H, C]``, int64)
    and ``prio`` (``[B, H, C]``, or a :class:`PagePriority`) need their last dimension contiguous."""
    b, h, k = pages.shape
    capacity = slot_page.shape[2]
    by_page = isinstance(prio, PagePriority)
    prio = prio.scores if by_page else prio
    slots = torch.empty((b, h, k), dtype=torch.int64, device=pages.device)
    miss = torch.empty((b, h, k), dtype=torch.bool, device=pages.device)
    if b * h * k == 0:
        return slots, miss
    for name, t in (("pages", pages), ("page_slot", page_slot), ("slot_page", slot_page),
                    ("last_used", last_used), ("prio", prio)):
        if t.stride(2) != 1:
            raise ValueError(f"place needs {name}'s last dimension contiguous, its strides are {t.stride()}")
    _place_op(pages, page_slot, slot_page, last_used, prio, head_capacity, slots, miss, step, by_page)
    return slots, miss


@torch.library.custom_op("kvdrive::place", mutates_args=("page_slot", "slot_page", "last_used", "slots", "miss"))
def _place_op(pages: torch.Tensor, page_slot: torch.Tensor, slot_page: torch.Tensor, last_used: torch.Tensor,
              prio: torch.Tensor, head_capacity: torch.Tensor | None, slots: torch.Tensor, miss: torch.Tensor,
              step: int, by_page: bool) -> None:
    """The launch of :func:`place`, as a torch op (:mod:`kvdrive.kernels.triton_ops`)."""
    b, h, k = pages.shape
    capacity = slot_page.shape[2]
    with _launch_lock:
        _place_kernel[(b * h,)](
            pages, page_slot, slot_page, last_used, prio, slots if head_capacity is None else head_capacity,
            slots, miss, h, k, capacity, page_slot.shape[2], prio.shape[2], step,
            *pages.stride()[:2], *page_slot.stride()[:2], *slot_page.stride()[:2], *last_used.stride()[:2],
            *prio.stride()[:2], *slots.stride()[:2],
            HAS_CAP=head_capacity is not None, BY_PAGE=by_page, BLOCK_K=_pow2(k, 1), BLOCK_C=_pow2(capacity, 1),
            num_warps=place_warps(capacity),
        )


def place_warps(capacity: int) -> int:
    """Warps of a placement program: 8 from 1024 slots on (on sm_90, 2048 slots in 4 warps spill
    a few bytes with LRU priorities, in 8 none)."""
    return 8 if capacity >= 1024 else 4


def place_signature(prio: str, k: int, capacity: int):
    """:func:`kvdrive.kernels.triton_kernels.compile_report`'s arguments for :func:`_place_kernel`
    with a ``prio`` of Triton type ``prio``, ``k`` pages and ``capacity`` slots, with head windows."""
    sig = {name: "i32" for name in _place_kernel.arg_names}
    sig.update(pages_ptr="*i64", page_slot_ptr="*i64", slot_page_ptr="*i64", last_used_ptr="*i64",
               prio_ptr="*" + prio, cap_ptr="*i64", slots_ptr="*i64", miss_ptr="*i1")
    const = dict(HAS_CAP=True, BY_PAGE=prio == "fp32", BLOCK_K=_pow2(k, 1), BLOCK_C=_pow2(capacity, 1))
    for name in const:
        sig[name] = "constexpr"
    return _place_kernel, sig, const, ("pages_ptr", "page_slot_ptr", "slot_page_ptr", "last_used_ptr", "prio_ptr",
                                       "slots_ptr", "miss_ptr")


# ---------------------------------------------------------------- landing fetched pages


@triton.jit(do_not_specialize=["n"])
def _land_kernel(kv_ptr, rows_ptr, k_ptr, v_ptr, n, skv_n, skv_kv, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``i``: fetched page ``i`` (``kv[i, 0]`` K, ``kv[i, 1]`` V, ``PAGE_ELEMS`` contiguous
    elements each) into row ``rows[i]`` of the caches viewed as ``[rows, PAGE_ELEMS]``."""
    i = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    em = e < PAGE_ELEMS
    row = tl.load(rows_ptr + i).to(tl.int64)
    src = kv_ptr + i * skv_n + e
    tl.store(k_ptr + row * PAGE_ELEMS + e, tl.load(src, mask=em).to(k_ptr.dtype.element_ty), mask=em)
    tl.store(v_ptr + row * PAGE_ELEMS + e, tl.load(src + skv_kv, mask=em).to(v_ptr.dtype.element_ty), mask=em)


def land(cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor) -> None:
    """:meth:`kvdrive.kernels.Kernels.land` in one Triton launch: fetched pages ``kv`` ``[n, 2, S, D]``
    (each page's K and V contiguous) into rows ``rows`` ``[n]`` of ``cache_k``/``cache_v``
    ``[B, H, C, S, D]`` (contiguous but for a batch slice) viewed as ``[B*H*C, S, D]``."""
    n = kv.shape[0]
    if n == 0:
        return
    _, h, c, s, d = cache_k.shape
    for name, t in (("cache_k", cache_k), ("cache_v", cache_v)):
        if t.stride()[1:] != (c * s * d, s * d, d, 1) or (t.shape[0] > 1 and t.stride(0) != h * c * s * d):
            raise ValueError(f"land needs {name} contiguous but for a batch slice, its strides are {t.stride()}")
    if kv.stride()[2:] != (d, 1):
        raise ValueError(f"land needs each fetched page contiguous, the strides are {kv.stride()}")
    _land_op(kv, rows, cache_k, cache_v)


@torch.library.custom_op("kvdrive::land", mutates_args=("cache_k", "cache_v"))
def _land_op(kv: torch.Tensor, rows: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
    """The launch of :func:`land`, as a torch op (:mod:`kvdrive.kernels.triton_ops`)."""
    n, s, d = kv.shape[0], cache_k.shape[3], cache_k.shape[4]
    with _launch_lock:
        _land_kernel[(n,)](kv, rows, cache_k, cache_v, n, kv.stride(0), kv.stride(1), PAGE_ELEMS=s * d,
                           BLOCK=_pow2(s * d, 1), num_warps=4)
