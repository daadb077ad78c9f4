"""A step's chosen pages in one Triton kernel (run on one H200 against torch's choice:
``tests/kernels/test_triton_gpu.py``).

:func:`choose_pages` is what a decode step does with a selector's page scores in torch
(``reference.topk_pages`` of the selectable pages, -1 where fewer than ``k`` have any
score, after the sink pages) in one launch: one program per (row, KV head) sorts
``(score, page)`` keys of its row, best first, ties to the lower page. Checked under
Triton's interpreter against the torch ops it replaces (``tests/kernels/test_triton.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdrive.kernels.triton_kernels import _launch_lock, _pow2
from kvdrive.kernels.triton_placement import _orderable


# Counts change from step to step: not specialised on (no recompiling).
@triton.jit(do_not_specialize=["P", "K", "SINK", "ssc_b", "ssc_h", "sse_b", "ssk_b"],
            do_not_specialize_on_alignment=["sel_ptr", "sink_ptr"])
def _choose_kernel(
    scores_ptr, sel_ptr, sink_ptr, out_ptr, H, P, K, SINK,
    ssc_b, ssc_h, sse_b, ssk_b, sout_b, sout_h,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (row x head): ``out[b, h]`` = the row's ``SINK`` sink pages, then its ``K`` best
    selectable pages by score (-1 where a page has none: -inf or not selectable)."""
    pair = tl.program_id(0)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    score = tl.load(scores_ptr + b * ssc_b + h * ssc_h + p, mask=pm, other=float("-inf"))
    ok = tl.load(sel_ptr + b * sse_b + p, mask=pm, other=0) != 0
    score = tl.where(ok, score, float("-inf"))
    # Best first: the order of -score; ties to the lower page; past P last.
    key = (_orderable(-score) << 32) | p.to(tl.int64)
    key = tl.where(pm, key, 0x7FFFFFFFFFFFFFFF)
    page = (tl.sort(key) & 0xFFFFFFFF).to(tl.int32)
    best = tl.gather(score, tl.maximum(tl.minimum(page, P - 1), 0), 0)
    picked = tl.where(best == float("-inf"), -1, page).to(tl.int64)
    out = out_ptr + b * sout_b + h * sout_h
    tl.store(out + SINK + p, picked, mask=p < K)
    s = tl.arange(0, BLOCK_S)
    tl.store(out + s, tl.load(sink_ptr + b * ssk_b + s, mask=s < SINK, other=-1), mask=s < SINK)


def choose_pages(scores: torch.Tensor, selectable: torch.Tensor, k: int, sink: torch.Tensor) -> torch.Tensor:
    """``[B, H, s + min(k, P)]`` int64: each row's sink pages ``sink`` ``[B, s]`` (-1: none),
    then per (row, head) the ``k`` best pages of ``scores`` ``[B, H, P]`` among ``selectable``
    ``[B, P]`` bool, best first, -1 where fewer have a score (-inf or not selectable)."""
    b, h, p = scores.shape
    num_sink, k = sink.shape[1], min(k, p)
    out = torch.empty((b, h, num_sink + k), dtype=torch.int64, device=scores.device)
    if b * h == 0 or num_sink + k == 0:
        return out
    if scores.stride(2) != 1 or selectable.stride(1) != 1 or (num_sink and sink.stride(1) != 1):
        raise ValueError("choose_pages needs the last dimension of scores, selectable and sink contiguous")
    _choose_op(scores, selectable, sink if num_sink else None, out, k)
    return out


@torch.library.custom_op("kvdrive::choose_pages", mutates_args=("out",))
def _choose_op(scores: torch.Tensor, selectable: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor,
               k: int) -> None:
    """The launch of :func:`choose_pages`, as a torch op (:mod:`kvdrive.kernels.triton_ops`)."""
    b, h, p = scores.shape
    num_sink = 0 if sink is None else sink.shape[1]
    block_p = _pow2(p, 1)
    with _launch_lock:
        _choose_kernel[(b * h,)](
            scores, selectable, sink if sink is not None else out, out, h, p, k, num_sink,
            scores.stride(0), scores.stride(1), selectable.stride(0), sink.stride(0) if num_sink else 0,
            out.stride(0), out.stride(1),
            BLOCK_P=block_p, BLOCK_S=_pow2(num_sink, 1), num_warps=8 if block_p >= 2048 else 4,
        )


def choose_signature(num_pages: int):
    """:func:`kvdrive.kernels.triton_kernels.compile_report`'s arguments for :func:`_choose_kernel`
    over ``num_pages`` pages (launched with 8 warps from 2048 on)."""
    sig = {name: "i32" for name in _choose_kernel.arg_names}
    sig.update(scores_ptr="*fp32", sel_ptr="*i1", sink_ptr="*i64", out_ptr="*i64")
    const = dict(BLOCK_P=_pow2(num_pages, 1), BLOCK_S=1)
    for name in const:
        sig[name] = "constexpr"
    return _choose_kernel, sig, const, ("scores_ptr", "out_ptr")


# ---------------------------------------------------------------- the step's selectable and sink pages


@triton.jit(do_not_specialize=["P", "SINK", "first_local", "sva_b", "sse_b", "ssk_b"],
            do_not_specialize_on_alignment=["valid_ptr", "sel_ptr", "sink_ptr"])
def _step_pages_kernel(valid_ptr, first_ptr, sel_ptr, sink_ptr, P, SINK, first_local, sva_b, sse_b, ssk_b,
                       PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                       SELECTABLE: tl.constexpr):
    """Program (row): its selectable pages ``sel[b, :P]`` and its sink ``sink[b, :SINK]``."""
    b = tl.program_id(0).to(tl.int64)
    first = tl.load(first_ptr + b)
    s = tl.arange(0, BLOCK_S)
    page = first + s
    tl.store(sink_ptr + b * ssk_b + s, tl.where(page < first_local, page, -1), mask=s < SINK)
    if SELECTABLE:
        t = tl.arange(0, BLOCK_T)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            pm = p < P
            real = tl.load(valid_ptr + b * sva_b + p[:, None] * PAGE + t[None, :], mask=pm[:, None] & (t < PAGE)[None, :],
                           other=0) != 0
            some = tl.max(real.to(tl.int32), axis=1) > 0
            tl.store(sel_ptr + b * sse_b + p, some & (p >= first + SINK) & (p < first_local), mask=pm)


def step_pages(valid: torch.Tensor, first_page: torch.Tensor, num_pages: int, sink: int, first_local: int,
               page_size: int, selectable: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:meth:`kvdrive.kernels.Kernels.step_pages` in one Triton launch (``valid``'s tokens contiguous)."""
    b = first_page.shape[0]
    sinks = torch.empty((b, sink), dtype=torch.int64, device=first_page.device)
    sel = torch.empty((b, num_pages), dtype=torch.bool, device=first_page.device) if selectable else None
    if valid.stride(1) != 1:
        raise ValueError("step_pages needs the token mask's tokens contiguous")
    if b:
        _step_pages_op(valid, first_page, sel, sinks, [num_pages, sink, first_local, page_size])
    return sel, sinks


@torch.library.custom_op("kvdrive::step_pages", mutates_args=("sel", "sinks"))
def _step_pages_op(valid: torch.Tensor, first_page: torch.Tensor, sel: torch.Tensor | None, sinks: torch.Tensor,
                   sizes: list[int]) -> None:
    """The launch of :func:`step_pages`, as a torch op (:mod:`kvdrive.kernels.triton_ops`)."""
    num_pages, sink, first_local, page_size = sizes
    block_t = _pow2(page_size, 1)
    with _launch_lock:
        _step_pages_kernel[(first_page.shape[0],)](
            valid, first_page, sel if sel is not None else sinks, sinks, num_pages, sink, first_local, valid.stride(0),
            sel.stride(0) if sel is not None else 0, sinks.stride(0),
            PAGE=page_size, BLOCK_P=max(1, 1024 // block_t), BLOCK_T=block_t, BLOCK_S=_pow2(sink, 1),
            SELECTABLE=sel is not None, num_warps=4,
        )


def step_pages_signature(page_size: int, sink: int):
    """:func:`kvdrive.kernels.triton_kernels.compile_report`'s arguments for :func:`_step_pages_kernel`."""
    sig = {name: "i32" for name in _step_pages_kernel.arg_names}
    sig.update(valid_ptr="*i1", first_ptr="*i64", sel_ptr="*i1", sink_ptr="*i64")
    block_t = _pow2(page_size, 1)
    const = dict(PAGE=page_size, BLOCK_P=max(1, 1024 // block_t), BLOCK_T=block_t, BLOCK_S=_pow2(sink, 1),
                 SELECTABLE=True)
    for name in const:
        sig[name] = "constexpr"
    return _step_pages_kernel, sig, const, ("first_ptr", "sink_ptr")
