"""How far a backend's result may be from the torch references, per (kernel, dtype).

The expected values always come from ``kvdrive.kernels.reference`` over float32 copies of
the inputs (the very values a half-precision input holds), so the ``dtype`` of a key is
the dtype of the backend's *result*: a result rounded to half precision is held to that
precision's tolerance, a float32 result to float32's, whatever the inputs were.

Integer and boolean results (pages, slots, misses, the cache maps, which tokens are
valid) have no entry: they must be equal.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # The numba scorer's exp2 is a degree-5 polynomial (relative error below 1e-4), and it
    # sums the logits in another order; fp16/bf16 queries are read in float32 by both backends.
    ("lowrank_scores", torch.float32): (1e-4, 1e-4),
    # The selection's scores are the same scores (the log taken for the k returned only).
    ("lowrank_select", torch.float32): (1e-4, 1e-4),
    # Where the CPU kernels score a layout's int4 and int2 channels by VNNI dot products
    # (kvdrive.kernels.cpu.lowrank_vnni; not the fused layout of head dim 64), those weights
    # are rounded to int8, each by up to 1/254 of the largest of its head's half of its kind:
    # on these cases' scores up to 7e-4 absolute was seen (the int16 weights of the other
    # path stay within the entries above). :func:`lowrank_kernel` picks the entry.
    ("lowrank_scores int8 weights", torch.float32): (2e-3, 2e-3),
    ("lowrank_select int8 weights", torch.float32): (2e-3, 2e-3),
    # exp(score) summed over a head's pages is its query-head count: P terms, each within
    # the scorer's 1e-4 of the reference.
    ("lowrank_mass", torch.float32): (1e-3, 1e-3),
    # q . (int8 mean) in float32 then times the page's scale, against q . (int8 x scale):
    # products of the same values in another order (seen: 1.4e-6 absolute at scores up to 10).
    ("hierarchical_select", torch.float32): (1e-5, 1e-5),
    # Both backends compute in float32 from the same widened K/V (fp16/bf16 -> float32 is
    # exact); softmax and the weighted sums in another order.
    ("attention", torch.float32): (1e-5, 1e-5),
    # A result returned in the input's half dtype is the float32 result rounded once:
    # half an ulp is 2**-11 relative for fp16, 2**-8 for bf16.
    ("attention", torch.float16): (1e-3, 1e-5),
    ("attention", torch.bfloat16): (8e-3, 1e-5),
    # Two parts merged through their log-sum-exps, against one call over all the tokens.
    ("attention_in_parts", torch.float32): (1e-5, 1e-6),
    # Both backends run the reference decode_attention over the same float32 values.
    ("dense_attention", torch.float32): (0.0, 0.0),
    # The Triton kernels (tests/kernels/test_triton.py, under Triton's interpreter) return
    # float32 whatever they read, so these are keyed by the dtype of the K/V they read.
    # float32: IEEE dots (not TF32), the softmax online over tiles and the chunks merged
    # through their log-sum-exps: the same sums in another order.
    ("triton_attention", torch.float32): (1e-5, 1e-5),
    # float16: half-precision dots with float32 accumulation (tensor cores on sm_90); the
    # softmax weights are rounded to half (2**-11 relative) before the dot with V.
    ("triton_attention", torch.float16): (3e-3, 3e-3),
    # Low-rank page scores: the query is widened to float32 in the kernel (exactly), then
    # float32 IEEE dots and a page-by-page log-sum-exp: float32's tolerance for both.
    ("triton_lowrank_scores", torch.float32): (1e-5, 1e-5),
    ("triton_lowrank_scores", torch.float16): (1e-5, 1e-5),
}


def lowrank_kernel(kernels, layout, kernel: str) -> str:
    """The tolerance entry of a low-rank ``kernel`` of backend ``kernels`` at ``layout``: its
    int8-weight one where the CPU kernels score that layout by VNNI on this host."""
    from kvdrive.kernels.cpu import lowrank  # noqa: PLC0415
    from kvdrive.kernels.cpu.lowrank_fused import is_fused  # noqa: PLC0415

    if kernels.name == "cpu" and not is_fused(layout.rank, layout.int8, layout.int2) and lowrank.vnni():
        return f"{kernel} int8 weights"
    return kernel


def tolerance(kernel: str, dtype: torch.dtype) -> dict[str, float]:
    """``rtol``/``atol`` for :func:`torch.testing.assert_close` (a missing entry is an error)."""
    rtol, atol = TOLERANCES[(kernel, dtype)]
    return {"rtol": rtol, "atol": atol}


def assert_close(got: torch.Tensor, expect: torch.Tensor, kernel: str, **kwargs) -> None:
    """``got`` against the float32 ``expect`` at the tolerance of ``got``'s dtype."""
    torch.testing.assert_close(got.float(), expect.float(), **tolerance(kernel, got.dtype), **kwargs)
