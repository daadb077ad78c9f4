"""The local window's ring (:mod:`kvdrive.kernels.window`) in Triton: a step's token in one launch.

:func:`append` writes one token's K and V into the ring slot of its position, for every
(row, KV head) in one launch (the torch version is two indexed copies). Checked under
Triton's interpreter against :meth:`kvdrive.kernels.Kernels.append` (``tests/kernels/test_window.py``);
it has not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdrive.kernels.triton_kernels import _launch_lock, _pow2
from kvdrive.kernels.window import LocalWindow


@triton.jit(do_not_specialize=["slot"])
def _append_kernel(key_ptr, value_ptr, k_ptr, v_ptr, slot, H, D, sk_b, sk_h, sv_b, sv_h, sr_b, sr_h, sr_c,
                   BLOCK_D: tl.constexpr):
    """Program (row x head): ``key[b, h]`` and ``value[b, h]`` (contiguous ``D``) into slot ``slot``
    of the rings ``k``/``v`` (same strides ``sr_*``, ``D`` contiguous)."""
    pair = tl.program_id(0)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    at = b * sr_b + h * sr_h + slot.to(tl.int64) * sr_c + d
    tl.store(k_ptr + at, tl.load(key_ptr + b * sk_b + h * sk_h + d, mask=dm).to(k_ptr.dtype.element_ty), mask=dm)
    tl.store(v_ptr + at, tl.load(value_ptr + b * sv_b + h * sv_h + d, mask=dm).to(v_ptr.dtype.element_ty), mask=dm)


def append(window: LocalWindow, key: torch.Tensor, value: torch.Tensor) -> None:
    """:meth:`kvdrive.kernels.Kernels.append` in one Triton launch: ``key``/``value`` ``[B, H, D]``
    or ``[B, H, 1, D]`` (head dim contiguous) into the slot of position ``window.end``."""
    b, h, _, d = window.k.shape
    if window.k.stride() != window.v.stride() or window.k.stride(3) != 1:
        raise ValueError(f"append needs rings of one layout, head dim contiguous: {window.k.stride()}, "
                         f"{window.v.stride()}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("append needs the token's head dim contiguous")
    if b * h == 0:
        return
    _append_op(key, value, window.k, window.v, window.slot(window.end))


@torch.library.custom_op("kvdrive::append", mutates_args=("k", "v"))
def _append_op(key: torch.Tensor, value: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> None:
    """The launch of :func:`append`, as a torch op (:mod:`kvdrive.kernels.triton_ops`)."""
    b, h, _, d = k.shape
    with _launch_lock:
        _append_kernel[(b * h,)](key, value, k, v, slot, h, d, key.stride(0), key.stride(1), value.stride(0),
                                 value.stride(1), *k.stride()[:3], BLOCK_D=_pow2(d, 1), num_warps=1)


def append_signature(dtype: str, head_dim: int):
    """:func:`kvdrive.kernels.triton_kernels.compile_report`'s arguments for :func:`_append_kernel`
    (K/V of Triton type ``dtype``, launched with one warp)."""
    sig = {name: "i32" for name in _append_kernel.arg_names}
    sig.update(key_ptr="*" + dtype, value_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype)
    const = dict(BLOCK_D=_pow2(head_dim, 1))
    for name in const:
        sig[name] = "constexpr"
    return _append_kernel, sig, const, ("key_ptr", "value_ptr", "k_ptr", "v_ptr")
