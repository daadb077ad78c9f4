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
    block_p = _pow2(p, 1)
    with _launch_lock:
        _choose_kernel[(b * h,)](
            scores, selectable, sink if num_sink else out, out, h, p, k, num_sink,
            scores.stride(0), scores.stride(1), selectable.stride(0), sink.stride(0) if num_sink else 0,
            out.stride(0), out.stride(1),
            BLOCK_P=block_p, BLOCK_S=_pow2(num_sink, 1), num_warps=8 if block_p >= 2048 else 4,
        )
    return out


def choose_signature(num_pages: int):
    """:func:`kvdrive.kernels.triton_kernels.compile_report`'s arguments for :func:`_choose_kernel`
    over ``num_pages`` pages (launched with 8 warps from 2048 on)."""
    sig = {name: "i32" for name in _choose_kernel.arg_names}
    sig.update(scores_ptr="*fp32", sel_ptr="*i1", sink_ptr="*i64", out_ptr="*i64")
    const = dict(BLOCK_P=_pow2(num_pages, 1), BLOCK_S=1)
    for name in const:
        sig[name] = "constexpr"
    return _choose_kernel, sig, const, ("scores_ptr", "out_ptr")
