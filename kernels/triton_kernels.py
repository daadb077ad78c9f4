"""Triton kernels for CUDA devices: paged sparse decode attention and fused low-rank page scores.

They are written for sm_90 (H100/H200) and have run on one H200 (README, "On a GPU";
``tests/kernels/test_triton_gpu.py``); :func:`_lowrank_weights_kernel` in its present form
(the head dim in slices) has not. They are checked two ways without a GPU: under Triton's interpreter on CPU tensors against the torch
references (``kvdrive.kernels.reference``), and compiled ahead of time for sm_90, where
:func:`compile_report` reads each kernel's registers and spills from the cubin.

The interpreter is chosen when a function is decorated with ``@triton.jit``: triton's own
helpers (``tl.zeros``, ``tl.sum``, ``tl.max``, ...) when ``triton`` is first imported, the
kernels here when this module is. ``TRITON_INTERPRET=1`` must therefore be in the
environment before the first ``import triton`` of the process, and torch imports triton
early (``torch._dynamo``, which loading a transformers model pulls in): in practice, set
it before the process starts. Set later, the two halves disagree and importing this
module raises ImportError. :data:`INTERPRETED` says which way it went.

Shapes as in ``reference``: ``B`` batch, ``H`` KV heads, ``G`` query heads per KV head,
``C`` cache slots per head, ``S`` tokens per page, ``D`` head dim.

**Attention** (:func:`sparse_attention`) reads K and V straight from the device-cache
slots and the local window (a ring of slots, :mod:`kvdrive.kernels.window`), no gathered copy. The attended tokens of a (row, KV head),
the selected pages then the local window, are split into chunks ("split-K"): the grid is
``(B * H, splits)``, so that a decode step's few (row, head) pairs still fill the GPU.
Each program runs an online softmax over its chunk, ``BLOCK_N`` tokens at a time, all
``G`` query heads of the KV head together (one ``tl.dot`` per tile, the query heads
padded to 16 rows), accumulating in float32, and writes its normalised partial output
and log-sum-exp per query head; a second small kernel merges the chunks through their
log-sum-exps. With one chunk the partial output is the result and no merge runs.

**Low-rank scores** (:func:`lowrank_scores`) are ``reference.score_lowrank`` over codes
packed as ``reference.pack_lowrank_codes`` lays them out, unpacked in the kernel: a small
kernel projects the query (``q @ qproj`` times the channel scales) into each code row's
channel weights; the grid is ``(B * H, splits)`` over pages; each program takes the
estimated logits of a tile
of pages, ``LOWRANK_ROW_CHUNK`` code rows at a time, and writes each page's
log-sum-exp per query head. A second kernel normalises those per
query head over all pages and sums each page's mass over the query heads. The page size
must be a power of two (the tile is reshaped to pages); :class:`TritonKernels` falls back
to the reference otherwise.

**Validity** (:class:`TokenValidity`): in a decode step attention reads which tokens are
real from the sequence's token mask, at the chosen pages' positions and the local
window's, and counts the attended ones, instead of a ``[B, H, tokens]`` mask built by
torch ops. Placement and landing fetched pages are in :mod:`.triton_placement`, the
step's page choice in :mod:`.triton_topk`. Counts and strides that change from step to
step are passed unspecialised (``do_not_specialize``), so a decode does not recompile.
Every launch goes through a torch custom op (:mod:`kvdrive.kernels.triton_ops`), so that a
decode step's device work traces as whole segments.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kvdrive.kernels import reference as ref
from kvdrive.kernels.backends import Kernels
from kvdrive.kernels.window import LocalWindow

NEG_INF = float("-inf")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Enough programs for a GPU of 132 SMs (H100/H200) to hold two each: a step whose
# (row, head) pairs are fewer splits its tokens until there are about this many.
TARGET_PROGRAMS = 264
# A chunk has at least this many attended tokens (pages: this many tokens' worth), so
# the partial results and their merge stay small next to the K/V read.
MIN_CHUNK_TOKENS = 256
# Code rows a low-rank tile's products take at once (a tl.dot needs 16 or more), and the
# low-rank kernel's software-pipeline depth: on sm_90, 16 rows and one stage compile to
# 96 registers; three stages keep the next tiles' codes in flight in 222, 32 rows in 3
# stages spill.
LOWRANK_ROW_CHUNK = 16
LOWRANK_NUM_STAGES = 1
# Head-dim slice of the low-rank query projection's products (the whole of D 128 at once spills).
WEIGHTS_BLOCK_D = 32


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(int(n), 1)))


def _splits(pairs: int, units: int, block: int, min_units: int, num_splits: int | None) -> tuple[int, int]:
    """(splits, units per split, a multiple of ``block``) for ``units`` (tokens or pages) per (row, head).

    Under the interpreter one split by default: there is no GPU to fill, and every program
    costs its Python overhead (tests of the splits pass ``num_splits``)."""
    if num_splits is None and INTERPRETED:
        num_splits = 1
    if num_splits is None:
        num_splits = min(triton.cdiv(TARGET_PROGRAMS, max(pairs, 1)), triton.cdiv(units, max(min_units, block)))
    num_splits = max(1, min(int(num_splits), triton.cdiv(units, block)))
    chunk = triton.cdiv(triton.cdiv(units, num_splits), block) * block
    return triton.cdiv(units, chunk), chunk


# ---------------------------------------------------------------- sparse decode attention


@triton.jit
def _softmax_step(q, kt, v, ok, m_i, l_i, acc, scaling, F32_DOT: tl.constexpr):
    """One tile of the online softmax: ``kt`` ``[BLOCK_D, BLOCK_N]`` keys (transposed), ``v``
    ``[BLOCK_N, BLOCK_D]`` values, ``ok`` ``[BLOCK_N]`` which of the tile's tokens count."""
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(ok[None, :], s * scaling, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: exp(-inf) stays 0
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if F32_DOT:
        acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


#: Whether the kernels here run under Triton's interpreter (decided when this module was imported).
INTERPRETED = not isinstance(_softmax_step, JITFunction)

if INTERPRETED == isinstance(tl.zeros, JITFunction):
    raise ImportError(
        f"TRITON_INTERPRET is {os.environ.get('TRITON_INTERPRET')!r} now but was not so when triton was first "
        f"imported: triton's helpers {'do not ' if INTERPRETED else ''}run under the interpreter, these kernels "
        f"{'would' if INTERPRETED else 'would not'}. Set TRITON_INTERPRET=1 before the process starts (torch "
        f"imports triton early) or not at all")


def _interpreter_loop_bounds() -> None:
    """Let the interpreter take tensors as loop bounds under numpy >= 2.4.

    Triton 3.6's interpreter turns a scalar (a one-element array) into a Python int with
    ``int(array)``, which numpy 2.4 refuses for arrays of one dimension: every loop whose
    bound is a kernel argument or a value computed in the kernel fails. This wraps the
    interpreter's per-launch patching of ``tl.tensor`` so that ``__index__`` takes the
    element; it changes nothing with older numpy and nothing outside the interpreter.
    """
    import numpy as np
    from triton.runtime import interpreter

    if np.lib.NumpyVersion(np.__version__) < "2.4.0":
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "kvdrive_loop_bounds", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.kvdrive_loop_bounds = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRETED:
    _interpreter_loop_bounds()


# The interpreter patches triton.language for the length of a launch and keeps the grid in
# a global: two launches at once (a decode pipeline's front thread scoring while the main
# thread attends) break each other. Interpreted launches take turns; compiled ones do not wait.
_launch_lock = threading.Lock() if INTERPRETED else nullcontext()


# Arguments that change from step to step (counts, lengths, strides of per-step tensors) are
# not specialised on (Triton otherwise compiles anew whenever one of them becomes 1 or
# a multiple of 16); the head-dim strides, 1, stay specialised.
@triton.jit(do_not_specialize=["K", "L", "chunk", "splits", "local_start", "local_first", "ring", "ssl_b", "ssl_h",
                               "slk_b", "slk_h", "slk_l", "slv_b", "slv_h", "slv_l", "sva_b", "sva_h", "spg_b", "spg_h"],
            do_not_specialize_on_alignment=["valid_ptr", "slots_ptr", "pages_ptr"])
def _sparse_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, slots_ptr, lk_ptr, lv_ptr, valid_ptr, part_ptr, lse_ptr, pages_ptr, count_ptr,
    scaling, H, G, D, K, L, chunk, splits, local_start, local_first, ring, count_at, context_at, context_times,
    sq_b, sq_h, sq_g, sq_d,
    skc_b, skc_h, skc_c, skc_s, skc_d,
    svc_b, svc_h, svc_c, svc_s, svc_d,
    ssl_b, ssl_h, ssl_k,
    slk_b, slk_h, slk_l, slk_d,
    slv_b, slv_h, slv_l, slv_d,
    sva_b, sva_h, sva_n,
    spg_b, spg_h, spg_k,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr, TOKENS: tl.constexpr = False, COUNT: tl.constexpr = False,
    CONTEXT: tl.constexpr = False,
):
    """Program (row x head, split): attention over attended tokens ``[split * chunk, (split + 1) * chunk)``.

    Writes the normalised partial output ``[B, H, splits, G, D]`` and the log-sum-exp
    ``[B, H, splits, G]`` (float32, contiguous; -inf and zeros where nothing was valid).

    Which tokens count: ``valid`` ``[B, H, >= K*PAGE + L]``, or with ``TOKENS`` the
    sequence's real tokens ``valid`` ``[B, >= t]`` (``sva_h`` unused) at the positions of
    the ``pages`` ``[B, H, K]`` (-1: none) and of the local window from ``local_start``
    (``reference.attended_valid`` in the kernel). With ``COUNT`` the tokens that count are
    added to ``count_ptr[count_at]`` (int64); with ``CONTEXT`` (and ``TOKENS``), each row's
    program (head 0, split 0) also adds ``context_times`` times the real tokens of
    ``[0, local_start + L)`` to ``count_ptr[context_at]``. The local window is a ring of
    ``ring`` slots (``kvdrive.kernels.window``): its token ``i`` sits in slot
    ``(local_first + i) % ring``.
    """
    pair = tl.program_id(0)
    split = tl.program_id(1)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    if CONTEXT:  # first, while few registers are live (after the loops it spills at fp32 D 128)
        if (h == 0) & (split == 0):  # the row's context, once per row
            real = tl.zeros([BLOCK_N], tl.int32)
            for n0 in range(0, local_start + L, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                inside = n < local_start + L
                real += ((tl.load(valid_ptr + b * sva_b + n * sva_n, mask=inside, other=0) != 0) & inside).to(tl.int32)
            tl.atomic_add(count_ptr + context_at, tl.sum(real, axis=0).to(tl.int64) * context_times)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :] * sq_d,
                mask=gm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    paged = K * PAGE
    start = split * chunk
    end = tl.minimum(start + chunk, paged + L)
    counted = tl.zeros([BLOCK_N], tl.int32)
    # The chunk's tokens in the selected pages, straight from their cache slots (-1: none).
    page_end = tl.minimum(end, paged)
    for n0 in range(start, page_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < page_end
        if TOKENS:
            page = tl.load(pages_ptr + b * spg_b + h * spg_h + (n // PAGE) * spg_k, mask=inside, other=-1)
            ok = tl.load(valid_ptr + b * sva_b + (tl.maximum(page, 0) * PAGE + n % PAGE) * sva_n,
                         mask=inside & (page >= 0), other=0) != 0
        else:
            ok = tl.load(valid_ptr + b * sva_b + h * sva_h + n * sva_n, mask=inside, other=0) != 0
        slot = tl.load(slots_ptr + b * ssl_b + h * ssl_h + (n // PAGE) * ssl_k, mask=inside, other=-1)
        ok = ok & inside & (slot >= 0)
        counted += ok.to(tl.int32)
        slot = tl.maximum(slot, 0).to(tl.int64)
        t = n % PAGE
        kt = tl.load(kc_ptr + (b * skc_b + h * skc_h + slot * skc_c + t * skc_s)[None, :] + d[:, None] * skc_d,
                     mask=ok[None, :] & dm[:, None], other=0.0)
        v = tl.load(vc_ptr + (b * svc_b + h * svc_h + slot * svc_c + t * svc_s)[:, None] + d[None, :] * svc_d,
                    mask=ok[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _softmax_step(q, kt, v, ok, m_i, l_i, acc, scaling, F32_DOT)
    # The chunk's tokens in the local window.
    for n0 in range(tl.maximum(start, paged), end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < end
        i = n - paged
        if TOKENS:
            ok = (tl.load(valid_ptr + b * sva_b + (local_start + i) * sva_n, mask=inside, other=0) != 0) & inside
        else:
            ok = (tl.load(valid_ptr + b * sva_b + h * sva_h + n * sva_n, mask=inside, other=0) != 0) & inside
        counted += ok.to(tl.int32)
        at = ((local_first + i) % ring).to(tl.int64)
        kt = tl.load(lk_ptr + (b * slk_b + h * slk_h + at * slk_l)[None, :] + d[:, None] * slk_d,
                     mask=ok[None, :] & dm[:, None], other=0.0)
        v = tl.load(lv_ptr + (b * slv_b + h * slv_h + at * slv_l)[:, None] + d[None, :] * slv_d,
                    mask=ok[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _softmax_step(q, kt, v, ok, m_i, l_i, acc, scaling, F32_DOT)
    if COUNT:
        tl.atomic_add(count_ptr + count_at, tl.sum(counted, axis=0).to(tl.int64))
    some = l_i > 0
    out = acc / tl.where(some, l_i, 1.0)[:, None]
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    row = (pair.to(tl.int64) * splits + split) * G
    tl.store(part_ptr + (row + g[:, None]) * D + d[None, :], out, mask=gm[:, None] & dm[None, :])
    tl.store(lse_ptr + row + g, lse, mask=gm)


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(part_ptr, lse_ptr, out_ptr, G, D, splits, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row x head): the chunks' partial outputs weighted by their log-sum-exps -> ``[B, H, G, D]``."""
    pair = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    mask = gm[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(0, splits):
        row = (pair * splits + s) * G
        lse = tl.load(lse_ptr + row + g, mask=gm, other=float("-inf"))
        part = tl.load(part_ptr + (row + g[:, None]) * D + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * part
        l = l * alpha + w
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (pair * G + g[:, None]) * D + d[None, :], out, mask=mask)


def _scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A float32 buffer every element of which a kernel here writes (results, partial results)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _check_kv(cache_k, cache_v, local_k, local_v) -> None:
    if cache_k.dtype not in _DTYPES:
        raise TypeError(f"sparse_attention reads float32, float16 or bfloat16 K/V, got {cache_k.dtype}")
    for name, t in (("cache_v", cache_v), ("local_k", local_k), ("local_v", local_v)):
        if t.dtype != cache_k.dtype:
            raise TypeError(f"cache_k is {cache_k.dtype} but {name} is {t.dtype}")


_workspaces = threading.local()


def _workspace(tag: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A :func:`_scratch` buffer for results a kernel here writes in full and the next reads
    (or that its caller reads before its next call), kept per thread and ``tag`` and reused
    while the shape stays: no allocation per launch."""
    if torch.compiler.is_compiling():  # a traced segment allocates once, from its graph's own pool
        return _scratch(shape, device)
    buffers = _workspaces.__dict__.setdefault("buffers", {})
    buf = buffers.get(tag)
    if buf is None or buf.shape != shape or buf.device != device:
        buf = buffers[tag] = _scratch(shape, device)
    return buf


def _as_bytes(valid: torch.Tensor) -> torch.Tensor:
    return valid.view(torch.uint8) if valid.dtype == torch.bool else valid


def _f32_dot(dtype: torch.dtype) -> bool:
    """Dots in float32 (IEEE, not TF32): float32 K/V, and bfloat16 under the interpreter,
    whose ``tl.dot`` multiplies bfloat16 bits as integers."""
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


def attention_block_n(dtype: torch.dtype) -> int:
    """Tokens per attention tile: the largest that compiles for sm_90 without spills at a
    head dim of 128 (:func:`sm90_configs`): 32 for half precision, 16 for float32, whose
    IEEE dots take the FMA path and hold their operands in registers. Under the
    interpreter 128: its cost is per operation, whatever the tile's size (tests of small
    tiles pass ``block_n``)."""
    if INTERPRETED:
        return 128
    return 16 if dtype == torch.float32 else 32


@dataclass
class TokenValidity:
    """Which attended tokens are real, for :func:`sparse_attention` to work out in its kernel
    (what :func:`kvdrive.kernels.reference.attended_valid` builds as a tensor): the sequence's
    real tokens ``tokens`` ``[B, >= t]`` bool, the attended ``pages`` ``[B, H, k]`` (-1: none;
    None: no pages) and the local window's first position. With ``count`` (an int64 tensor
    and an index) attention adds the real attended tokens to that element."""

    tokens: torch.Tensor
    pages: torch.Tensor | None
    local_start: int
    count: tuple[torch.Tensor, int] | None = None
    #: ``(index, times)``: attention also adds ``times`` the real tokens of the context (the
    #: tokens before the local window's end) to element ``index`` of ``count``'s tensor.
    context: tuple[int, int] | None = None


def sparse_attention(query: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                     local_k: torch.Tensor, local_v: torch.Tensor, valid: torch.Tensor | TokenValidity,
                     scaling: float, *, block_n: int | None = None, num_splits: int | None = None,
                     ring: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over cache slots, then the local window, in two Triton kernels.

    Arguments as :func:`kvdrive.kernels.reference.sparse_attention`: query ``[B, H, G, D]``,
    ``cache_k``/``cache_v`` ``[B, H, C, S, D]``, ``slots`` ``[B, H, k]`` (-1: no page),
    ``local_k``/``local_v`` ``[B, H, L, D]``, ``valid`` ``[B, H, >= k*S + L]`` bool for
    the tokens in that order, or a :class:`TokenValidity` (``slots`` -1 where its pages
    are). K/V float32, float16 or bfloat16, any strides; the query
    is cast to their dtype. Returns float32 ``[B, H, G, D]``, zeros for a (row, head)
    with nothing valid. ``block_n``: tokens per tile (None: :func:`attention_block_n`);
    ``num_splits`` forces the chunks per (row, head) (None: enough for
    :data:`TARGET_PROGRAMS` programs, at least :data:`MIN_CHUNK_TOKENS` tokens each).
    ``ring``: ``(first, length)``, the local window as a ring (:class:`kvdrive.kernels.window.LocalWindow`):
    its ``length`` tokens from slot ``first`` of ``local_k``/``local_v``, wrapping around.
    ``out``: where the result goes (float32, ``[B, H, G, D]`` contiguous, or any shape of as many elements).
    """
    _check_kv(cache_k, cache_v, local_k, local_v)
    b, h, g, d = query.shape
    k, s = slots.shape[2], cache_k.shape[3]
    first, l = ring if ring is not None else (0, local_k.shape[2])
    n = k * s + l
    by_tokens = isinstance(valid, TokenValidity)
    if not by_tokens and valid.shape[2] < n:
        raise ValueError(f"valid covers {valid.shape[2]} tokens, the pages and local window {n}")
    if b * h * g == 0 or (n == 0 and not (by_tokens and valid.context is not None)):
        return torch.zeros(b, h, g, d, dtype=torch.float32, device=query.device)
    if query.dtype != cache_k.dtype:
        query = query.to(cache_k.dtype)
    context_at, context_times, context = 0, 0, False
    if by_tokens:
        pages = valid.pages if valid.pages is not None else slots
        counts, count_at = valid.count if valid.count is not None else (slots, 0)
        if valid.context is not None and valid.count is not None:
            (context_at, context_times), context = valid.context, True
        local_start, count = valid.local_start, valid.count is not None
        valid = valid.tokens
    else:
        pages, counts, count_at, local_start, count = slots, slots, 0, 0, False
        valid = _as_bytes(valid)
    block_n = block_n or attention_block_n(cache_k.dtype)
    splits, chunk = _splits(b * h, max(n, 1), block_n, MIN_CHUNK_TOKENS, num_splits)
    if splits == 1:  # the one chunk's output is the result
        part = out if out is not None else _scratch((b, h, g, d), query.device)
    else:
        part = _workspace("attention part", (b, h, splits, g, d), query.device)
        out = out if out is not None else _scratch((b, h, g, d), query.device)
    lse = _workspace("attention lse", (b, h, splits, g), query.device)
    _attention_op(query, cache_k, cache_v, slots, local_k, local_v, valid, part, lse, pages, counts if count else None,
                  None if splits == 1 else out, float(scaling), [l, chunk, splits, local_start, first, count_at,
                                                                  context_at, context_times, block_n],
                  [by_tokens, context])
    return part if splits == 1 else out


@torch.library.custom_op("kvdrive::attention", mutates_args=("part", "lse", "counts", "out"))
def _attention_op(query: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                  local_k: torch.Tensor, local_v: torch.Tensor, valid: torch.Tensor, part: torch.Tensor,
                  lse: torch.Tensor, pages: torch.Tensor, counts: torch.Tensor | None, out: torch.Tensor | None,
                  scaling: float, sizes: list[int], flags: list[bool]) -> None:
    """The launches of :func:`sparse_attention` (a torch op, so that a step's segment traces:
    :mod:`kvdrive.kernels.triton_ops`). ``sizes``: window length, chunk, splits, local start,
    ring's first slot, count and context indices, context multiplier, tokens per tile;
    ``flags``: validity by tokens, context counted. ``out`` None: one split, ``part`` is it."""
    b, h, g, d = query.shape
    k, s = slots.shape[2], cache_k.shape[3]
    l, chunk, splits, local_start, first, count_at, context_at, context_times, block_n = sizes
    by_tokens, context = flags
    valid_strides = (valid.stride(0), 0, valid.stride(1)) if by_tokens else valid.stride()
    block_g, block_d = _pow2(g), _pow2(d)
    with _launch_lock:
        _sparse_attention_kernel[(b * h, splits)](
            query, cache_k, cache_v, slots, local_k, local_v, valid, part, lse, pages,
            counts if counts is not None else slots, scaling, h, g, d, k, l, chunk, splits, local_start, first,
            max(local_k.shape[2], 1), count_at, context_at, context_times, *query.stride(), *cache_k.stride(),
            *cache_v.stride(), *slots.stride(), *local_k.stride(), *local_v.stride(), *valid_strides,
            *pages.stride(), PAGE=s if k else 1, BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_D=block_d,
            F32_DOT=_f32_dot(cache_k.dtype), TOKENS=by_tokens, COUNT=counts is not None, CONTEXT=context,
            num_warps=4,
        )
        if out is not None:
            _merge_kernel[(b * h,)](part, lse, out, g, d, splits, BLOCK_G=block_g, BLOCK_D=block_d, num_warps=4)


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor | TokenValidity, scaling: float, **kwargs) -> torch.Tensor:
    """:func:`kvdrive.kernels.reference.decode_attention` over ``[B, H, N, D]`` keys/values
    (``valid`` ``[B, H, N]``, or a :class:`TokenValidity` without pages) by
    :func:`sparse_attention` with no pages; float32."""
    return sparse_attention(query, keys[:, :, None], values[:, :, None], _no_pages(keys), keys, values, valid, scaling,
                            **kwargs)


def _no_pages(keys: torch.Tensor) -> torch.Tensor:
    return torch.empty(*keys.shape[:2], 0, dtype=torch.int64, device=keys.device)


# ---------------------------------------------------------------- low-rank page scores


@triton.jit
def _row_channel(row, j, N8, N4, R, ROWS8, ROWS4, ROWS):
    """Channel ``j`` of each packed code row, and whether the row holds one: int8 rows hold
    one channel, int4 rows two, int2 rows four (the low-rank layout)."""
    chan4 = N8 + 2 * (row - ROWS8) + j
    chan2 = N8 + N4 + 4 * (row - ROWS4) + j
    chan = tl.where(row < ROWS8, row, tl.where(row < ROWS4, chan4, chan2))
    ok = tl.where(row < ROWS8, j == 0, tl.where(row < ROWS4, (j < 2) & (chan4 < N8 + N4), chan2 < R))
    return chan, ok & (row < ROWS)


@triton.jit
def _code_rows_logits(logits, w_row, codes_row, sw_ab, sw_r, scd_r, t, tm, gm, r_first, r_last,
                      PER_ROW: tl.constexpr, ROW_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """``logits`` plus the estimated logits of code rows ``[r_first, r_last)``, each holding
    ``PER_ROW`` channels (1: int8, 2: int4 nibbles, 4: int2 fields, lowest bits first)."""
    for r0 in range(r_first, r_last, ROW_CHUNK):
        r = r0 + tl.arange(0, ROW_CHUNK)
        rm = r < r_last
        wm = gm[:, None] & rm[None, :]
        x = tl.load(codes_row + r[:, None] * scd_r + t[None, :], mask=rm[:, None] & tm[None, :], other=0).to(tl.int32)
        if PER_ROW == 1:
            w0 = tl.load(w_row + r[None, :] * sw_r, mask=wm, other=0.0)
            logits += tl.dot(w0, x.to(tl.float32), input_precision=PRECISION)
        elif PER_ROW == 2:
            w0 = tl.load(w_row + r[None, :] * sw_r, mask=wm, other=0.0)
            w1 = tl.load(w_row + sw_ab + r[None, :] * sw_r, mask=wm, other=0.0)
            logits += tl.dot(w0, (((x & 15) ^ 8) - 8).to(tl.float32), input_precision=PRECISION)
            logits += tl.dot(w1, (x >> 4).to(tl.float32), input_precision=PRECISION)
        else:
            for j in tl.static_range(4):
                wj = tl.load(w_row + j * sw_ab + r[None, :] * sw_r, mask=wm, other=0.0)
                if j == 3:
                    v = x >> 6
                else:
                    v = (((x >> (2 * j)) & 3) ^ 2) - 2
                logits += tl.dot(wj, v.to(tl.float32), input_precision=PRECISION)
    return logits


@triton.jit(do_not_specialize=["P", "pages_per_split", "scd_b", "scd_h", "sva_b"],
            do_not_specialize_on_alignment=["valid_ptr"])
def _lowrank_page_lse_kernel(
    w_ptr, codes_ptr, valid_ptr, plse_ptr,
    H, G, ROWS8, ROWS4, ROWS, P, pages_per_split,
    sw_ab, sw_b, sw_h, sw_g, sw_r,
    scd_b, scd_h, scd_r, scd_t,
    sva_b, sva_t,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr, ROW_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    """Program (row x head, split): for pages ``[split * pages_per_split, ...)``, each page's
    log-sum-exp of the estimated logits per query head -> ``plse`` ``[B, H, G, P]`` float32.

    ``w`` ``[4, B, H, G, ROWS]`` (:func:`_code_row_weights`): per code row, the weight of each
    channel it holds. Rows ``[0, ROWS8)`` are int8, ``[ROWS8, ROWS4)`` int4 pairs, the rest
    int2 quads. A tile's logits are summed over ``ROW_CHUNK`` code rows at a time, so that a
    thread never holds its share of a whole sketch (a rank-44 sketch in one product spills
    on sm_90)."""
    pair = tl.program_id(0)
    split = tl.program_id(1)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    w_row = w_ptr + b * sw_b + h * sw_h + g[:, None] * sw_g
    codes_row = codes_ptr + b * scd_b + h * scd_h
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, P)
    for p0 in range(first, last, BLOCK_P):
        t = p0 * PAGE + tl.arange(0, BLOCK_P * PAGE)
        tm = t < last * PAGE
        logits = tl.zeros([BLOCK_G, BLOCK_P * PAGE], tl.float32)
        logits = _code_rows_logits(logits, w_row, codes_row, sw_ab, sw_r, scd_r, t * scd_t, tm, gm, 0, ROWS8,
                                   1, ROW_CHUNK, PRECISION)
        logits = _code_rows_logits(logits, w_row, codes_row, sw_ab, sw_r, scd_r, t * scd_t, tm, gm, ROWS8, ROWS4,
                                   2, ROW_CHUNK, PRECISION)
        logits = _code_rows_logits(logits, w_row, codes_row, sw_ab, sw_r, scd_r, t * scd_t, tm, gm, ROWS4, ROWS,
                                   4, ROW_CHUNK, PRECISION)
        ok = (tl.load(valid_ptr + b * sva_b + t * sva_t, mask=tm, other=0) != 0) & tm
        logits = tl.where(ok[None, :], logits, float("-inf"))
        per_page = tl.reshape(logits, (BLOCK_G, BLOCK_P, PAGE))
        top = tl.max(per_page, axis=2)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(tl.exp(per_page - top_safe[:, :, None]), axis=2)
        page_lse = tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        p = p0 + tl.arange(0, BLOCK_P)
        tl.store(plse_ptr + ((pair.to(tl.int64) * G + g[:, None]) * P + p[None, :]), page_lse,
                 mask=gm[:, None] & (p < last)[None, :])


@triton.jit
def _lowrank_weights_kernel(
    q_ptr, qp_ptr, scale_ptr, w_ptr, scaling,
    H, G, D, R, N8, N4, ROWS8, ROWS4, ROWS, sw_ab,
    sq_b, sq_h, sq_g, sq_d, sqp_b, sqp_h, sqp_d, sqp_r, ssc_b, ssc_h, ssc_r,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Program (row x head): ``w`` ``[4, B, H, G, ROWS]`` (contiguous), per code row of
    ``reference.pack_lowrank_codes`` the weight of each channel it holds, in its order (0
    past a row's channels): the channels of ``reference.project_lowrank_query``, the query
    times ``qproj`` times each channel's scale and ``scaling``."""
    pair = tl.program_id(0)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    row = tl.arange(0, BLOCK_ROWS)
    gm = g < G
    q_row = q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g
    for j in tl.static_range(4):
        chan, ok = _row_channel(row, j, N8, N4, R, ROWS8, ROWS4, ROWS)
        proj = tl.zeros([BLOCK_G, BLOCK_ROWS], tl.float32)
        for d0 in range(0, D, BLOCK_D):  # a slice of the head dim at a time: no spills at D 128
            d = d0 + tl.arange(0, BLOCK_D)
            dm = d < D
            q = tl.load(q_row + d[None, :] * sq_d, mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            qp = tl.load(qp_ptr + b * sqp_b + h * sqp_h + d[:, None] * sqp_d + chan[None, :] * sqp_r,
                         mask=dm[:, None] & ok[None, :], other=0.0).to(tl.float32)
            proj = tl.dot(q, qp, proj, input_precision="ieee")
        sc = tl.load(scale_ptr + b * ssc_b + h * ssc_h + chan * ssc_r, mask=ok, other=0.0).to(tl.float32)
        w = proj * (sc * scaling)[None, :]
        tl.store(w_ptr + j * sw_ab + ((pair.to(tl.int64) * G + g[:, None]) * ROWS + row[None, :]), w,
                 mask=gm[:, None] & (row < ROWS)[None, :])


def _code_row_weights(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                      layout: ref.SketchLayout, w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[4, B, H, G, rows]`` float32 (:func:`_lowrank_weights_kernel`) in one launch."""
    b, h, g, d = query.shape
    _lowrank_weights_kernel[(b * h,)](
        query, qproj, scale, w, float(scaling),
        h, g, d, layout.rank, layout.int8, layout.int4, layout.int8, layout.int8 + layout.int4_rows, layout.rows,
        w.stride(0), *query.stride(), *qproj.stride(), *scale.stride(),
        BLOCK_G=_pow2(g), BLOCK_D=WEIGHTS_BLOCK_D, BLOCK_ROWS=_pow2(layout.rows), num_warps=4,
    )
    return w


@triton.jit(do_not_specialize=["P"])
def _lowrank_mass_kernel(plse_ptr, out_ptr, G, P, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program (row x head): page scores ``[B, H, P]``, the log of each page's mass summed
    over the query heads, each head's logits normalised over all pages (-inf: no mass)."""
    pair = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    rows = plse_ptr + (pair * G + g[:, None]) * P
    # Each query head's log-sum-exp over every page (0 where it has nothing, as the reference's).
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        x = tl.load(rows + p[None, :], mask=gm[:, None] & (p < P)[None, :], other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
    norm = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), 0.0)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pm = p < P
        y = tl.load(rows + p[None, :], mask=gm[:, None] & pm[None, :], other=float("-inf")) - norm[:, None]
        top = tl.max(y, axis=0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(tl.exp(y - top_safe[None, :]), axis=0)
        score = tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(out_ptr + pair * P + p, score, mask=pm)


def lowrank_supported(page_size: int) -> bool:
    """Whether :func:`lowrank_scores` takes this page size (a power of two)."""
    return page_size >= 1 and page_size & (page_size - 1) == 0


def lowrank_block_p(page_size: int) -> int:
    """Pages per low-rank tile: 128 tokens' worth (one page if pages are longer); under the
    interpreter 1024 tokens' worth (its cost is per operation, whatever the tile's size)."""
    return max(1, (1024 if INTERPRETED else 128) // page_size)


def lowrank_scores(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                   codes: torch.Tensor, valid: torch.Tensor, num_pages: int, page_size: int,
                   layout: ref.SketchLayout, *, block_p: int | None = None,
                   num_splits: int | None = None, reuse_out: bool = False) -> torch.Tensor:
    """Fused :func:`kvdrive.kernels.reference.score_lowrank` from packed codes, in three Triton
    kernels (the query's projection, the pages' log-sum-exps, their masses).

    Arguments as :func:`kvdrive.kernels.cpu.lowrank_scores`: query ``[B, H, G, D]``, qproj
    ``[B, H, D, R]``, scale ``[B, H, R]``, ``codes`` ``[B, H, rows, >= P*S]`` int8 as
    :func:`reference.pack_lowrank_codes` lays them out for ``layout``, ``valid`` ``[B, >= P*S]``;
    spare capacity past ``num_pages`` is not read. The page size must be a power of two.
    Returns float32 ``[B, H, P]`` (-inf: a page with no mass). ``block_p``: pages per tile
    (None: :func:`lowrank_block_p`); ``num_splits`` as :func:`sparse_attention`'s, in pages.
    ``reuse_out``: the result is a buffer this thread's next call overwrites (read it before then).
    """
    if not lowrank_supported(page_size):
        raise ValueError(f"lowrank_scores takes a power-of-two page size, got {page_size}")
    if layout.rank != qproj.shape[3]:
        raise ValueError(f"a sketch layout of rank {layout.rank} for a projection of rank {qproj.shape[3]}")
    b, h, g, d = query.shape
    out = (_workspace("lowrank scores", (b, h, num_pages), query.device) if reuse_out
           else _scratch((b, h, num_pages), query.device))
    if b * h == 0 or num_pages == 0:
        return out
    block_p = block_p or lowrank_block_p(page_size)
    splits, per_split = _splits(b * h, num_pages, block_p, triton.cdiv(MIN_CHUNK_TOKENS, page_size), num_splits)
    plse = _workspace("lowrank page lse", (b, h, g, num_pages), query.device)
    weights = _workspace("lowrank weights", (4, b, h, g, layout.rows), query.device)
    _lowrank_scores_op(query, qproj, scale, codes, valid, weights, plse, out, float(scaling),
                       [layout.rank, layout.int8, layout.int2, page_size, block_p, per_split, splits])
    return out


@torch.library.custom_op("kvdrive::lowrank_scores", mutates_args=("weights", "plse", "out"))
def _lowrank_scores_op(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor,
                       valid: torch.Tensor, weights: torch.Tensor, plse: torch.Tensor, out: torch.Tensor,
                       scaling: float, sizes: list[int]) -> None:
    """The launches of :func:`lowrank_scores`, as a torch op (:mod:`kvdrive.kernels.triton_ops`).
    ``sizes``: the layout's rank, int8 and int2 channels, page size, pages per tile and per split, splits."""
    rank, int8, int2, page_size, block_p, per_split, splits = sizes
    layout = ref.SketchLayout(rank, int8, int2)
    b, h, g, _ = query.shape
    block_g = _pow2(g)
    rows8, rows4 = layout.int8, layout.int8 + layout.int4_rows
    num_pages = out.shape[2]
    with _launch_lock:
        _code_row_weights(query, qproj, scale, scaling, layout, weights)
        _lowrank_page_lse_kernel[(b * h, splits)](
            weights, codes, valid, plse,
            h, g, rows8, rows4, layout.rows, num_pages, per_split,
            *weights.stride(), *codes.stride(), *valid.stride(),
            PAGE=page_size, BLOCK_P=block_p, BLOCK_G=block_g, ROW_CHUNK=LOWRANK_ROW_CHUNK, num_warps=4,
            num_stages=LOWRANK_NUM_STAGES,
        )
        _lowrank_mass_kernel[(b * h,)](plse, out, g, num_pages, BLOCK_G=block_g, BLOCK_P=128, num_warps=4)


def lowrank_select(query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout, **kwargs):
    """:func:`kvdrive.kernels.reference.lowrank_select` with the scores of :func:`lowrank_scores`
    (torch's top-k afterwards)."""
    scores = lowrank_scores(query, qproj, scale, scaling, codes, valid, selectable.shape[1], page_size, layout,
                            **kwargs)
    pages, top = ref.topk_pages(scores.masked_fill(~selectable[:, None, :], NEG_INF), k)
    return pages, top, None if cached is None else ref.gather_scores(scores, cached)


# ---------------------------------------------------------------- the kernel set


class TritonKernels(Kernels):
    """Attention (which tokens are real worked out in it), low-rank scoring, the page choice
    (:mod:`.triton_topk`), placement and landing fetched pages (:mod:`.triton_placement`) in
    Triton; the other selectors' scoring stays the torch references. On CUDA tensors, or on
    CPU tensors under the interpreter (``TRITON_INTERPRET=1``). Attention returns float32
    and attends in one pass, after the fetched pages land."""

    name = "triton"
    attends_in_parts = False

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cpu" and not INTERPRETED:
            raise ValueError("kernels='triton' runs on CPU tensors only under Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before kvdrive.kernels.triton_kernels is first imported")
        super().__init__(device, one_thread=device.type == "cpu", widen_half=True)

    def lowrank_scores(self, query, qproj, scale, scaling, codes, valid, num_pages, page_size, layout):
        if not lowrank_supported(page_size):
            return super().lowrank_scores(query, qproj, scale, scaling, codes, valid, num_pages, page_size, layout)
        return lowrank_scores(query, qproj, scale, scaling, codes, valid, num_pages, page_size, layout)

    def lowrank_select(self, query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout):
        if not lowrank_supported(page_size):
            return super().lowrank_select(query, qproj, scale, scaling, codes, valid, selectable, k, page_size,
                                          cached, layout)
        return lowrank_select(query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout)

    def lowrank_choose(self, query, index, selectable, k, sink, cached):
        """Scores as :meth:`lowrank_scores`, then the choice in one kernel
        (:func:`kvdrive.kernels.triton_topk.choose_pages`); the cached pages' scores are left for
        the placement kernel to read (:class:`kvdrive.kernels.triton_placement.PagePriority`)."""
        if not lowrank_supported(index.page_size):
            return super().lowrank_choose(query, index, selectable, k, sink, cached)
        from kvdrive.kernels.triton_placement import PagePriority  # noqa: PLC0415 - they import this module
        from kvdrive.kernels.triton_topk import choose_pages  # noqa: PLC0415

        # Read by the choice and this micro-batch's placement, both before this thread scores again.
        scores = lowrank_scores(query, index.qproj, index.scale, index.scaling, index.codes, index.valid,
                                selectable.shape[1], index.page_size, index.layout, reuse_out=True)
        return choose_pages(scores, selectable, k, sink), None if cached is None else PagePriority(scores)

    def step_pages(self, valid, first_page, num_pages, sink, first_local, page_size, selectable=True):
        from kvdrive.kernels.triton_topk import step_pages  # noqa: PLC0415 - it imports this module

        return step_pages(valid, first_page, num_pages, sink, first_local, page_size, selectable)

    def lowrank_add_page(self, index, keys, valid):
        from kvdrive.kernels.triton_index import lowrank_encode_page  # noqa: PLC0415 - it imports this module

        lowrank_encode_page(keys, valid, index.kproj, index.scale, index.layout, index.codes, index.valid,
                            index.num_pages * index.page_size)

    def attended_valid(self, valid, chosen, page_size, local_start, t, heads):
        """A :class:`TokenValidity`: attention works out which attended tokens are real itself."""
        return TokenValidity(valid, chosen, local_start)

    def count_attended(self, valid, counts, index, context=None):
        if not isinstance(valid, TokenValidity):
            return super().count_attended(valid, counts, index, context)
        valid.count = (counts, index)  # attention adds them as it attends
        if context is not None:  # attention counts the tokens before its window's end: t, as the caller's
            _, _, at, times = context
            valid.context = (at, times)
        return None

    def append(self, window, key, value):
        from kvdrive.kernels.triton_window import append  # noqa: PLC0415 - it imports this module

        append(window, key, value)

    def land(self, cache_k, cache_v, rows, kv):
        from kvdrive.kernels.triton_placement import land  # noqa: PLC0415 - it imports this module

        land(cache_k, cache_v, rows, kv)

    def place(self, pages, page_slot, slot_page, last_used, prio, head_capacity, step):
        from kvdrive.kernels.triton_placement import place  # noqa: PLC0415 - it imports this module

        return place(pages, page_slot, slot_page, last_used, prio, head_capacity, step)

    def attention(self, query, cache_k, cache_v, slots, local_k, local_v, valid, scaling, partial=None):
        if partial is not None:
            raise NotImplementedError(f"{self.name} kernels attend in one pass")
        return sparse_attention(query, cache_k, cache_v, slots, local_k, local_v, valid, scaling)

    def dense_attention(self, query, keys, values, valid, scaling):
        return dense_attention(query, keys, values, valid, scaling)

    def attend_window(self, query, cache_k, cache_v, slots, window, valid, scaling, partial=None):
        """Attention straight from the window's ring (no linear copy of it)."""
        if partial is not None:
            raise NotImplementedError(f"{self.name} kernels attend in one pass")
        if window is None:
            empty = cache_k.new_empty(*cache_k.shape[:2], 0, cache_k.shape[4])
            window = LocalWindow(empty, empty, 0, 0)
        if slots is None:  # the window alone
            cache_k, cache_v, slots = window.k[:, :, None], window.v[:, :, None], _no_pages(window.k)
        return sparse_attention(query, cache_k, cache_v, slots, window.k, window.v, valid, scaling,
                                ring=(window.first, window.length))


# ---------------------------------------------------------------- ahead-of-time compilation

#: The GPU every kernel here is compiled for ahead of time: H100/H200 (compute capability 9.0, warps of 32).
SM90 = ("cuda", 90, 32)


def nvidia_tool(name: str) -> Path | None:
    """A CUDA tool bundled with triton (``ptxas``, ``cuobjdump``), or on the PATH; None if neither."""
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return bundled
    found = shutil.which(name)
    return Path(found) if found else None


def compile_report(kernel, signature: dict[str, str], constants: dict[str, object], target=SM90,
                   num_warps: int = 4, num_stages: int = 3, divisible: tuple[str, ...] = ()) -> dict:
    """Compile ``kernel`` for ``target`` (no GPU needed) and read its resource use from the cubin.

    ``signature``: every argument's Triton type (``"*fp16"``, ``"i32"``, ``"fp32"``;
    ``"constexpr"`` for those in ``constants``); ``divisible``: arguments known to be
    multiples of 16 (pointers, strides), as the JIT would specialise them. Returns
    ``registers``, ``spill_stores``/``spill_loads`` (bytes, from ``ptxas -v``),
    ``local``/``stack``/``shared`` (bytes, from ``cuobjdump --dump-resource-usage``) and
    ``num_warps``. Needs the kernels compiled, not interpreted (``TRITON_INTERPRET`` unset
    when this module was imported), and the bundled ``ptxas`` and ``cuobjdump``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, JITFunction):
        raise RuntimeError("compile_report needs compiled kernels: import kvdrive.kernels.triton_kernels "
                           "with TRITON_INTERPRET unset")
    ptxas, cuobjdump = nvidia_tool("ptxas"), nvidia_tool("cuobjdump")
    if ptxas is None or cuobjdump is None:
        raise FileNotFoundError("ptxas and cuobjdump not found (neither bundled with triton nor on the PATH)")
    names = kernel.arg_names
    sig = {name: signature[name] for name in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(fn=kernel, signature=sig, constexprs=dict(constants), attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget(*target), options={"num_warps": num_warps,
                                                                        "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx_path.write_text(ptx)
        cubin_path.write_bytes(compiled.asm["cubin"])
        ptxas_log = subprocess.run([str(ptxas), "-v", f"-arch={arch}", str(ptx_path), "-o", str(Path(tmp) / "v.o")],
                                   capture_output=True, text=True, check=True).stderr
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin_path)],
                               capture_output=True, text=True, check=True).stdout

    def field(text, pattern):
        found = re.search(pattern, text)
        if found is None:
            raise RuntimeError(f"no {pattern!r} in:\n{text}")
        return int(found.group(1))

    return {
        "kernel": kernel.__name__,
        "arch": arch,
        "num_warps": compiled.metadata.num_warps,
        "registers": field(usage, r"REG:(\d+)"),
        "stack": field(usage, r"STACK:(\d+)"),
        "local": field(usage, r"LOCAL:(\d+)"),
        "shared": field(usage, r"SHARED:(\d+)"),
        "spill_stores": field(ptxas_log, r"(\d+) bytes spill stores"),
        "spill_loads": field(ptxas_log, r"(\d+) bytes spill loads"),
        "ptxas_registers": field(ptxas_log, r"Used (\d+) registers"),
    }


_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _attention_signature(dtype: torch.dtype, page: int, g: int, d: int, block_n: int | None = None):
    """Signature and constants of :func:`_sparse_attention_kernel` as :func:`sparse_attention`
    launches it on contiguous K/V (head dim stride 1, the rest multiples of 16)."""
    kv = "*" + _TL[dtype]
    sig = {name: "i32" for name in _sparse_attention_kernel.arg_names}
    sig.update(q_ptr=kv, kc_ptr=kv, vc_ptr=kv, lk_ptr=kv, lv_ptr=kv, slots_ptr="*i64", valid_ptr="*i1",
               part_ptr="*fp32", lse_ptr="*fp32", pages_ptr="*i64", count_ptr="*i64", scaling="fp32")
    # As a decode step launches it: validity from the tokens (TokenValidity), counted, the context too (layer 0).
    const = dict(PAGE=page, BLOCK_N=block_n or attention_block_n(dtype), BLOCK_G=_pow2(g), BLOCK_D=_pow2(d),
                 F32_DOT=dtype == torch.float32, TOKENS=True, COUNT=True, CONTEXT=True, sq_d=1, skc_d=1, svc_d=1, ssl_k=1,
                 slk_d=1, slv_d=1, sva_n=1, spg_k=1)
    for name in const:
        sig[name] = "constexpr"
    # Not the per-step strides and pointers the kernel is not specialised on.
    divisible = ("q_ptr", "kc_ptr", "vc_ptr", "lk_ptr", "lv_ptr", "part_ptr", "lse_ptr",
                 "skc_b", "skc_h", "skc_c", "skc_s", "svc_b", "svc_h", "svc_c", "svc_s")
    return sig, const, divisible


def _merge_signature(g: int, d: int):
    sig = dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*fp32", G="i32", D="i32", splits="i32",
               BLOCK_G="constexpr", BLOCK_D="constexpr")
    return sig, dict(BLOCK_G=_pow2(g), BLOCK_D=_pow2(d)), ("part_ptr", "lse_ptr", "out_ptr")


def _lowrank_signature(page: int, g: int):
    sig = {name: "i32" for name in _lowrank_page_lse_kernel.arg_names}
    sig.update(w_ptr="*fp32", codes_ptr="*i8", valid_ptr="*i1", plse_ptr="*fp32")
    const = dict(PAGE=page, BLOCK_P=lowrank_block_p(page), BLOCK_G=_pow2(g), ROW_CHUNK=LOWRANK_ROW_CHUNK,
                 PRECISION="ieee", sw_r=1, scd_t=1, sva_t=1)
    for name in const:
        sig[name] = "constexpr"
    return sig, const, ("w_ptr", "codes_ptr", "plse_ptr")


def _weights_signature(g: int, d: int, rows: int):
    sig = {name: "i32" for name in _lowrank_weights_kernel.arg_names}
    sig.update(q_ptr="*fp16", qp_ptr="*fp16", scale_ptr="*fp32", w_ptr="*fp32", scaling="fp32")
    const = dict(BLOCK_G=_pow2(g), BLOCK_D=WEIGHTS_BLOCK_D, BLOCK_ROWS=_pow2(rows), sq_d=1, sqp_r=1, ssc_r=1)
    for name in const:
        sig[name] = "constexpr"
    return sig, const, ("q_ptr", "qp_ptr", "scale_ptr", "w_ptr")


def _mass_signature(g: int):
    sig = dict(plse_ptr="*fp32", out_ptr="*fp32", G="i32", P="i32", BLOCK_G="constexpr", BLOCK_P="constexpr")
    return sig, dict(BLOCK_G=_pow2(g), BLOCK_P=128), ("plse_ptr", "out_ptr")


def sm90_configs() -> dict[str, tuple]:
    """Every kernel in the shapes KVDrive runs (Llama-3-8B: G 4, D 128; SmolLM2-135M: G 3, D 64;
    pages of 16), launched as KVDrive launches it: name -> (kernel, signature, constants,
    divisible, pipeline stages[, warps when not 4]). The low-rank kernel's code rows are a runtime count, so one
    build serves every rank and head dim (G 3 and 4 both pad to 16 query rows)."""
    configs = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for g, d in ((4, 128), (3, 64)):
            configs[f"attention {_TL[dtype]} G{g} D{d}"] = (_sparse_attention_kernel,
                                                            *_attention_signature(dtype, 16, g, d), 3)
    configs["merge G4 D128"] = (_merge_kernel, *_merge_signature(4, 128), 3)
    from kvdrive.kernels.triton_placement import place_signature, place_warps  # noqa: PLC0415 - it imports this module

    # Placement: 128 pages selected of 2048 slots (a 32K context at a 16th, a 16x cache), both policies.
    for prio in ("fp32", "i64"):
        configs[f"place {prio} K128 C2048"] = (*place_signature(prio, 128, 2048), 3, place_warps(2048))
    configs["lowrank G4"] = (_lowrank_page_lse_kernel, *_lowrank_signature(16, 4), LOWRANK_NUM_STAGES)
    configs["lowrank mass G4"] = (_lowrank_mass_kernel, *_mass_signature(4), 3)
    configs["lowrank weights G4 D128"] = (_lowrank_weights_kernel, *_weights_signature(4, 128, 22), 3)
    from kvdrive.kernels.triton_topk import choose_signature, step_pages_signature  # noqa: PLC0415 - it imports this module

    configs["choose P2048"] = (*choose_signature(2048), 3, 8)
    configs["step pages S16"] = (*step_pages_signature(16, 1), 3)
    from kvdrive.kernels.triton_index import encode_signature  # noqa: PLC0415 - it imports this module
    from kvdrive.kernels.triton_window import append_signature  # noqa: PLC0415 - it imports this module

    configs["encode page S16 D128 R44"] = (*encode_signature(16, 128, 22), 3)
    configs["append fp16 D128"] = (*append_signature("fp16", 128), 3, 1)
    return configs


def sm90_reports() -> dict[str, dict]:
    """:func:`compile_report` of every :func:`sm90_configs` entry."""
    return {name: compile_report(kernel, sig, const, divisible=div, num_stages=stages, num_warps=warps)
            for name, (kernel, sig, const, div, stages, *more) in sm90_configs().items()
            for warps in [more[0] if more else 4]}


if __name__ == "__main__":  # python -m kvdrive.kernels.triton_kernels: the sm_90 resource report as JSON
    import json

    print(json.dumps(sm90_reports(), indent=1))
