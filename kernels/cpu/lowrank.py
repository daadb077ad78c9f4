"""Low-rank page scores and top-k selection: the compiled entry points, one pair per kind of
code layout, and their Python wrappers (scratch kept per thread, calls split across threads).

A layout's kind decides which logits its entry points compile (:func:`.lowrank_fused.is_fused`):
the fused pass of the default layout at head dim 64 (:mod:`.lowrank_fused`), or the generated
int8/int4/int2 passes of every other layout (:mod:`.lowrank_passes`). Each entry point's
compile holds its own kind's logits only, so a model of the fused layout never compiles the
passes, the larger part of the compile.
"""

from __future__ import annotations

import logging
import os
import threading

import numba
import numpy as np
import torch

from kvdrive.kernels import reference as ref
from kvdrive.kernels.cpu.lowrank_fused import _fused_page_mass, is_fused
from kvdrive.kernels.cpu.lowrank_mass import _choose, _log_mass, _lowrank_weights
from kvdrive.kernels.cpu.lowrank_passes import _SLOT_SPARE, _passes_page_mass
from kvdrive.kernels.cpu.lowrank_vnni import available as vnni_available
from kvdrive.kernels.cpu.threads import _cut, _in_parts, parts_for
from kvdrive.protocol import jit_cache

jit_cache.use("kvdrive.kernels")  # before the definitions below: they cache where it says

log = logging.getLogger(__name__)

# The entry points of a pair take the same arguments; the fused ones ignore wide, narrow, vnni and ws.


@numba.njit(nogil=True, cache=True)
def _lowrank_scores_fused(query, qproj, scale, scaling, codes, wide, narrow, vnni, valid, p_n, s_n, out, w, logits, ws,
                          top):  # pragma: no cover - compiled
    """Each (row, head)'s page scores into ``out`` ``[B, H, P]``, for the fused layout."""
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            _lowrank_weights(query, qproj, scale, scaling, b, h, w)
            _fused_page_mass(w, codes, valid, b, h, p_n, s_n, logits, top, out[b, h])
            for p in range(p_n):
                out[b, h, p] = _log_mass(out[b, h, p])


@numba.njit(nogil=True, cache=True)
def _lowrank_scores_passes(query, qproj, scale, scaling, codes, wide, narrow, vnni, valid, p_n, s_n, out, w, logits, ws,
                           top):  # pragma: no cover - compiled
    """:func:`_lowrank_scores_fused` for every other layout."""
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            _lowrank_weights(query, qproj, scale, scaling, b, h, w)
            _passes_page_mass(w, codes, wide, narrow, vnni, valid, b, h, p_n, s_n, logits, ws, top, out[b, h])
            for p in range(p_n):
                out[b, h, p] = _log_mass(out[b, h, p])


@numba.njit(nogil=True, cache=True)
def _lowrank_select_fused(query, qproj, scale, scaling, codes, wide, narrow, vnni, valid, selectable, k, p_n, s_n,
                          sink, unscored, out_pages, out_scores, cached, cached_scores, w, logits, ws, top, score,
                          cand):  # pragma: no cover - compiled
    """Per (row, head): ``out_pages`` ``[B, H, s + k]`` is the row's ``sink`` pages ``[B, s]`` then its
    top ``k`` by mass (:func:`.lowrank_mass._lowrank_top`; their log masses in ``out_scores`` ``[B, H, k]``, the
    log taken for those only). With ``unscored`` a pick scored -inf, and each of the ``k`` a
    row with fewer selectable pages lacks, is -1; without, the lacking ones are unselectable
    pages scored -inf (``s`` must then be 0).
    Scratch (:func:`_lowrank_work`): ``w`` ``[G, R]``, ``logits`` ``[G, >= P*S]``, ``ws``
    ``[G, R + _SLOT_SPARE]``, ``top`` ``[G]``, ``score`` and ``cand`` ``[>= P]``."""
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            _lowrank_weights(query, qproj, scale, scaling, b, h, w)
            _fused_page_mass(w, codes, valid, b, h, p_n, s_n, logits, top, score)
            _choose(score, b, h, selectable, k, p_n, sink, unscored, out_pages, out_scores, cached, cached_scores, cand)


@numba.njit(nogil=True, cache=True)
def _lowrank_select_passes(query, qproj, scale, scaling, codes, wide, narrow, vnni, valid, selectable, k, p_n, s_n,
                           sink, unscored, out_pages, out_scores, cached, cached_scores, w, logits, ws, top, score,
                           cand):  # pragma: no cover - compiled
    """:func:`_lowrank_select_fused` for every other layout."""
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            _lowrank_weights(query, qproj, scale, scaling, b, h, w)
            _passes_page_mass(w, codes, wide, narrow, vnni, valid, b, h, p_n, s_n, logits, ws, top, score)
            _choose(score, b, h, selectable, k, p_n, sink, unscored, out_pages, out_scores, cached, cached_scores, cand)


_NO_CACHED = np.full((0, 0, 0), -1, np.int64)


_work = threading.local()


def _lowrank_work(g_n: int, r_n: int, p_n: int, s_n: int) -> tuple[np.ndarray, ...]:
    """The calling thread's scratch for the low-rank kernels (w, logits, ws, top, score, cand), kept between calls.

    Fresh scratch each call (about 100 KiB at a 7K context) page-faulted in on every
    call where the model's forward pass had handed freed memory back to the OS: tens
    of faults per layer. Grown by a quarter past the need, never shrunk.
    """
    bufs = getattr(_work, "lowrank", None)
    t_n = max(p_n * s_n, 1)
    if bufs is None or bufs[0].shape != (g_n, r_n) or bufs[1].shape[1] < t_n or bufs[4].shape[0] < p_n:
        t_cap, p_cap = t_n + t_n // 4, max(p_n + p_n // 4, 1)
        if bufs is not None and bufs[0].shape == (g_n, r_n):
            t_cap, p_cap = max(t_cap, bufs[1].shape[1]), max(p_cap, bufs[4].shape[0])
        bufs = (np.empty((g_n, r_n), np.float32), np.empty((g_n, t_cap), np.float32),
                np.empty((g_n, r_n + _SLOT_SPARE), np.float32), np.empty(g_n, np.float32), np.empty(p_cap, np.float32),
                np.empty(p_cap, np.float32))
        _work.lowrank = bufs
    return bufs


def _f32(t: torch.Tensor) -> np.ndarray:
    """A float32 numpy view of ``t`` (a copy only when its dtype differs; no new tensor for a
    float32 one that needs no detaching, the decode's query)."""
    if t.dtype == torch.float32 and not t.requires_grad:
        return t.numpy()
    return t.detach().to(torch.float32).numpy()


def _projection(t: torch.Tensor) -> np.ndarray:
    """The query projection as the kernels take it: an fp16 one as its bits (uint16), widened
    in the kernel (a torch or numpy widening of its few KiB cost 20-30 us a call), others float32."""
    if t.dtype == torch.float16:
        return t.detach().view(torch.int16).numpy().view(np.uint16)
    return _f32(t)


VNNI_ENV = "KVDRIVE_LOWRANK_VNNI"


def vnni() -> bool:
    """Whether the passes' int4 and int2 channels go by VNNI dot products (:mod:`.lowrank_vnni`):
    where the host has them, unless ``KVDRIVE_LOWRANK_VNNI=0``. Logs once where they do not."""
    off = os.environ.get(VNNI_ENV, "1") == "0"
    if vnni_available() and not off:
        return True
    if getattr(vnni, "logged", None) != off:
        vnni.logged = off
        why = f"{VNNI_ENV}=0" if off else "no AVX-512 VNNI and VBMI for numba on this host (or its LLVM lacks them)"
        log.info("%s: the low-rank index's int4 and int2 channels are scored by int16 multiply-adds (about half "
                 "the speed at layouts other than head dim 64's)", why)
    return False


def _layout(qproj: torch.Tensor | np.ndarray, layout: ref.SketchLayout) -> tuple[int, int, bool]:
    """(int8 channels, int2 channels, whether it is the fused layout) of ``layout``, which must be
    the projection's rank."""
    if layout.rank != qproj.shape[3]:
        raise ValueError(f"a sketch layout of rank {layout.rank} for a projection of rank {qproj.shape[3]}")
    return layout.int8, layout.int2, is_fused(layout.rank, layout.int8, layout.int2)


def _kernel_of(qproj: torch.Tensor | np.ndarray, layout: ref.SketchLayout, scaling: float) -> tuple:
    """What a select call takes besides the arrays: (int8 channels, int2 channels, whether by VNNI,
    the select entry point of ``layout``'s kind, ``scaling`` as float32)."""
    wide, narrow, fused = _layout(qproj, layout)
    return (wide, narrow, not fused and vnni(), _lowrank_select_fused if fused else _lowrank_select_passes,
            np.float32(scaling))


def lowrank_scores(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                   codes: torch.Tensor, valid: torch.Tensor, num_pages: int, page_size: int,
                   layout: ref.SketchLayout) -> torch.Tensor:
    """Fused :func:`kvdrive.kernels.reference.score_lowrank`, the query projection included.

    Same arguments, except that ``codes`` are packed as :func:`reference.pack_lowrank_codes`
    lays them out for ``layout``, and that they and ``valid``
    ``[B, >= P*S]`` may have spare capacity past ``num_pages`` pages (no copy is made).
    Returns float32 ``[B, H, P]``, within 1e-4 of the reference (the exponential is a polynomial)
    at the default layout of head dim 64; other layouts round their int4 and int2 weights to
    int16 (:func:`.lowrank_passes._slot_weights`), within 3e-3 at Gemma 3's rank 108 on random
    codes, or where the host has VNNI (:func:`vnni`) to int8 (:mod:`.lowrank_vnni`), about twice that.
    A large call runs in parts on up to :func:`kernel_threads` threads (:func:`_in_parts`).
    """
    out = np.empty((query.shape[0], query.shape[1], num_pages), np.float32)
    q, qp, sc, cd, ok = _f32(query), _projection(qproj), scale.numpy(), codes.numpy(), valid.numpy()
    (wide, narrow, fused), scaling = _layout(qproj, layout), np.float32(scaling)
    kernel = _lowrank_scores_fused if fused else _lowrank_scores_passes
    by_vnni = not fused and vnni()

    def part(bs, hs):
        q_, qp_, sc_, cd_, ok_, out_ = _cut((q, qp, sc, cd, ok, out), bs, hs, rows_only=(4,))
        kernel(q_, qp_, sc_, scaling, cd_, wide, narrow, by_vnni, ok_, num_pages, page_size, out_,
               *_lowrank_work(q.shape[2], qp.shape[3], num_pages, page_size)[:4])  # no top-k scratch

    _in_parts(q.shape[0], q.shape[1], num_pages * page_size * q.shape[2], part)
    return torch.from_numpy(out)


def lowrank_select(query: torch.Tensor, qproj: torch.Tensor, scale: torch.Tensor, scaling: float,
                   codes: torch.Tensor, valid: torch.Tensor, selectable: torch.Tensor, k: int, page_size: int,
                   cached: torch.Tensor | None, layout: ref.SketchLayout,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``k`` selectable pages of highest :func:`lowrank_scores`, in one compiled call.

    ``selectable`` ``[B, P]`` says how many pages there are. With ``cached`` (``[B, H, n]``
    pages, -1 none) it also returns their scores, for lookahead eviction. Returns
    (pages ``[B, H, k]``, their scores, cached pages' scores or None); with fewer than
    ``k`` selectable pages the rest are unselectable ones scored -inf. Threads as
    :func:`lowrank_scores`.
    """
    arrays = (_projection(qproj), scale.numpy(), codes.numpy(), valid.numpy())
    sink = np.empty((query.shape[0], 0), np.int64)
    pages, scores, cached_scores = _select(query, arrays, _kernel_of(arrays[0], layout, scaling), selectable, k,
                                           page_size, sink, False, cached)
    return torch.from_numpy(pages), torch.from_numpy(scores), cached_scores


def lowrank_choose(query: torch.Tensor, index, selectable: torch.Tensor, k: int, sink: torch.Tensor,
                   cached: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`kvdrive.kernels.backends.Kernels.lowrank_choose` in one compiled call: each row's
    ``sink`` pages, then :func:`lowrank_select`'s pages with -1 for those without a score.

    The kernel writes the sink and the -1s itself, where the reference concatenates and
    masks in torch, and the index's arrays are viewed once (:func:`_index_arrays`): a
    decode step calls this once per layer, after the model's forward pass has pushed
    torch's dispatch code and these arrays out of the caches, so each torch op left out
    saves several times its warm cost."""
    arrays, entry = _index_arrays(index)
    chosen, _, cached_scores = _select(query, arrays, entry, selectable, k, index.page_size,
                                       np.ascontiguousarray(sink.numpy(), np.int64), True, cached)
    return torch.from_numpy(chosen), cached_scores


def _index_arrays(index) -> tuple[tuple[np.ndarray, ...], tuple]:
    """A low-rank index's (qproj, scale, codes, valid) as the kernels take them and its
    :func:`_kernel_of`, kept on the index while its tensors, layout and scaling are the same
    objects (pages added in place show through the views; an index that grew has new tensors,
    and a view of some rows, :meth:`Selector.rows`, its own). Each step calls this once a
    layer, after the model's layers have pushed this code out of the caches: at Gemma 3's
    16K tokens the layout's checks, done anew, cost about 12 us a call."""
    tensors = (index.qproj, index.scale, index.codes, index.valid, index.layout, index.scaling)
    kept = getattr(index, "_cpu_arrays", None)
    if kept is None or any(a is not b for a, b in zip(kept[0], tensors)):
        arrays = (_projection(index.qproj), index.scale.numpy(), index.codes.numpy(), index.valid.numpy())
        kept = (tensors, arrays, _kernel_of(arrays[0], index.layout, index.scaling))
        index._cpu_arrays = kept
    return kept[1], kept[2]


def _select(query: torch.Tensor, arrays: tuple[np.ndarray, ...], entry: tuple, selectable: torch.Tensor, k: int,
            page_size: int, sink: np.ndarray, unscored: bool, cached: torch.Tensor | None,
            ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
    """``_lowrank_select_*`` over ``arrays`` (:func:`_index_arrays`) as ``entry`` (:func:`_kernel_of`)
    says: (pages ``[B, H, s + k]``, their scores ``[B, H, k]``, the cached pages' scores or None).
    A call in one part goes straight to the kernel, with no closure or slicing."""
    num_pages = selectable.shape[1]
    k = min(k, num_pages)
    b, h = query.shape[:2]
    qp, sc, cd, ok = arrays
    wide, narrow, by_vnni, kernel, scaling = entry
    pages = np.empty((b, h, sink.shape[1] + k), np.int64)
    scores = np.empty((b, h, k), np.float32)
    cached_np = _NO_CACHED if cached is None else cached.numpy()
    cached_scores = np.empty(cached_np.shape, np.float32)
    q, sel = _f32(query), selectable.numpy()
    work = num_pages * page_size * q.shape[2]
    if parts_for(b, h, work) == 1:
        kernel(q, qp, sc, scaling, cd, wide, narrow, by_vnni, ok, sel, k, num_pages, page_size, sink, unscored, pages,
               scores, cached_np, cached_scores, *_lowrank_work(q.shape[2], qp.shape[3], num_pages, page_size))
        return pages, scores, None if cached is None else torch.from_numpy(cached_scores)

    def part(bs, hs):  # without cached pages, the empty arrays slice to empty arrays
        q_, qp_, sc_, cd_, ok_, sel_, sink_, pages_, scores_, cached_, cached_scores_ = _cut(
            (q, qp, sc, cd, ok, sel, sink, pages, scores, cached_np, cached_scores), bs, hs, rows_only=(4, 5, 6))
        kernel(q_, qp_, sc_, scaling, cd_, wide, narrow, by_vnni, ok_, sel_, k, num_pages, page_size, sink_, unscored,
               pages_, scores_, cached_, cached_scores_, *_lowrank_work(q.shape[2], qp.shape[3], num_pages, page_size))

    _in_parts(b, h, work, part)
    return pages, scores, None if cached is None else torch.from_numpy(cached_scores)
