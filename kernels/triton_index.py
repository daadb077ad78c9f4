"""A page completed while decoding, into the low-rank index, in one Triton launch.

:func:`lowrank_encode_page` is what :meth:`kvdrive.kernels.Kernels.lowrank_add_page` does in
torch (the keys' sketches ``keys @ kproj``, over each channel's scale, quantised and packed
as ``reference.quantize_lowrank`` and ``reference.pack_lowrank_codes`` lay them out, and the
page's token mask copied) in one program per (row, KV head) instead of some sixty torch ops.
Checked under Triton's interpreter against the torch version (``tests/kernels/test_window.py``);
it has not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdrive.kernels import reference as ref
from kvdrive.kernels.triton_kernels import WEIGHTS_BLOCK_D, _launch_lock, _pow2, _row_channel


@triton.jit
def _round_half_even(x):
    """``torch.round``: to the nearest integer, halves to the even one."""
    f = tl.floor(x)
    r = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)


@triton.jit(do_not_specialize=["col", "sk_b", "sk_h", "sk_s", "scd_b", "scd_h", "sva_b", "svo_b"])
def _encode_kernel(
    keys_ptr, kproj_ptr, scale_ptr, valid_ptr, codes_ptr, valid_out_ptr,
    H, S, D, R, N8, N4, ROWS8, ROWS4, ROWS, col,
    sk_b, sk_h, sk_s, sk_d, skp_b, skp_h, skp_d, skp_r, ssc_b, ssc_h, ssc_r,
    scd_b, scd_h, scd_r, sva_b, sva_s, svo_b,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Program (row x head): the code rows of tokens ``[col, col + S)`` of ``codes`` ``[B, H, ROWS, >= col + S]``
    from ``keys`` ``[B, H, S, D]``; head 0's program also copies the page's mask ``valid`` ``[B, S]``."""
    pair = tl.program_id(0)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    sm = s < S
    row = tl.arange(0, BLOCK_ROWS)
    code = tl.zeros([BLOCK_S, BLOCK_ROWS], tl.int32)
    for j in tl.static_range(4):
        chan, ok = _row_channel(row, j, N8, N4, R, ROWS8, ROWS4, ROWS)
        z = tl.zeros([BLOCK_S, BLOCK_ROWS], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dm = d < D
            k = tl.load(keys_ptr + b * sk_b + h * sk_h + s[:, None] * sk_s + d[None, :] * sk_d,
                        mask=sm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            kp = tl.load(kproj_ptr + b * skp_b + h * skp_h + d[:, None] * skp_d + chan[None, :] * skp_r,
                         mask=dm[:, None] & ok[None, :], other=0.0).to(tl.float32)
            z = tl.dot(k, kp, z, input_precision="ieee")
        sc = tl.load(scale_ptr + b * ssc_b + h * ssc_h + chan * ssc_r, mask=ok, other=1.0)
        x = z / sc[None, :]
        wide = (row < ROWS8)[None, :]
        lo = tl.where(wide, -127.0, tl.where((row < ROWS4)[None, :], -8.0, -2.0))
        hi = tl.where(wide, 127.0, tl.where((row < ROWS4)[None, :], 7.0, 1.0))
        q = tl.minimum(tl.maximum(tl.where(wide, _round_half_even(x), tl.floor(x)), lo), hi).to(tl.int32)
        q = tl.where(ok[None, :], q, 0)
        bits = tl.where(wide, q & 0xFF, tl.where((row < ROWS4)[None, :], (q & 0xF) << (4 * j), (q & 0x3) << (2 * j)))
        code = code | bits
    tl.store(codes_ptr + b * scd_b + h * scd_h + row[None, :] * scd_r + (col + s)[:, None],
             code.to(tl.int8), mask=sm[:, None] & (row < ROWS)[None, :])
    if h == 0:
        tl.store(valid_out_ptr + b * svo_b + col + s, tl.load(valid_ptr + b * sva_b + s * sva_s, mask=sm), mask=sm)


def lowrank_encode_page(keys: torch.Tensor, valid: torch.Tensor, kproj: torch.Tensor, scale: torch.Tensor,
                        layout: ref.SketchLayout, codes: torch.Tensor, codes_valid: torch.Tensor, col: int) -> None:
    """One page's keys ``[B, H, S, D]`` into code columns ``[col, col + S)`` of ``codes`` ``[B, H, rows, >= col + S]``
    int8 (last dimension contiguous), its mask ``valid`` ``[B, S]`` bool into ``codes_valid`` ``[B, >= col + S]``;
    ``kproj`` ``[B, H, D, R]``, ``scale`` ``[B, H, R]``: :meth:`kvdrive.kernels.Kernels.lowrank_add_page`'s result."""
    b, h, s, d = keys.shape
    if codes.stride(3) != 1 or codes_valid.stride(1) != 1:
        raise ValueError("lowrank_encode_page needs the token dimension of codes and their mask contiguous")
    if b * h * s == 0:
        return
    _encode_op(keys, valid, kproj, scale, codes, codes_valid, [layout.rank, layout.int8, layout.int2, col])


@torch.library.custom_op("kvdrive::encode_page", mutates_args=("codes", "codes_valid"))
def _encode_op(keys: torch.Tensor, valid: torch.Tensor, kproj: torch.Tensor, scale: torch.Tensor,
               codes: torch.Tensor, codes_valid: torch.Tensor, sizes: list[int]) -> None:
    """The launch of :func:`lowrank_encode_page`, as a torch op (:mod:`kvdrive.kernels.triton_ops`).
    ``sizes``: the layout's rank, int8 and int2 channels, the first column."""
    rank, int8, int2, col = sizes
    layout = ref.SketchLayout(rank, int8, int2)
    b, h, s, d = keys.shape
    with _launch_lock:
        _encode_kernel[(b * h,)](
            keys, kproj, scale, valid, codes, codes_valid,
            h, s, d, layout.rank, layout.int8, layout.int4, layout.int8, layout.int8 + layout.int4_rows, layout.rows,
            col, *keys.stride(), *kproj.stride(), *scale.stride(), *codes.stride()[:3], *valid.stride(),
            codes_valid.stride(0),
            BLOCK_S=_pow2(s), BLOCK_D=WEIGHTS_BLOCK_D, BLOCK_ROWS=_pow2(layout.rows), num_warps=4,
        )


def encode_signature(page_size: int, head_dim: int, rows: int):
    """:func:`kvdrive.kernels.triton_kernels.compile_report`'s arguments for :func:`_encode_kernel`
    (fp16 keys and projection, ``rows`` code rows)."""
    sig = {name: "i32" for name in _encode_kernel.arg_names}
    sig.update(keys_ptr="*fp16", kproj_ptr="*fp16", scale_ptr="*fp32", valid_ptr="*i1", codes_ptr="*i8",
               valid_out_ptr="*i1")
    const = dict(BLOCK_S=_pow2(page_size), BLOCK_D=WEIGHTS_BLOCK_D, BLOCK_ROWS=_pow2(rows), sk_d=1, skp_r=1,
                 ssc_r=1, sva_s=1)
    for name in const:
        sig[name] = "constexpr"
    return _encode_kernel, sig, const, ("keys_ptr", "kproj_ptr", "scale_ptr", "codes_ptr")
