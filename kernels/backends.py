"""The kernel sets a session can run: the torch references, and the compiled CPU kernels.

A :class:`Kernels` object gives a decode step everything it runs per (row, KV head):
selection (low-rank and hierarchical), device-cache placement, which attended tokens
are real, and sparse attention over cache slots plus the local window. It also says
in which dtype attention reads K and V, whether attention can be taken in two parts
(cached pages while the misses are fetched, then the fetched ones) and under which
threading context a step's own torch ops run.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from kvdrive.kernels import cpu
from kvdrive.kernels import reference as ref
from kvdrive.kernels.transfer import HostTransfer
from kvdrive.kernels.window import LocalWindow

_HALF = (torch.float16, torch.bfloat16)


class Kernels:
    """The torch reference kernels (any device). Subclasses override what they compile."""

    name = "reference"
    #: Attention can run over the cached pages while the misses are fetched, then over the fetched ones.
    attends_in_parts = False

    def __init__(self, device: torch.device, one_thread: bool = False, widen_half: bool = False) -> None:
        self.device = device
        self._one_thread = one_thread
        self._widen_half = widen_half
        #: How fetched pages reach the device (:mod:`kvdrive.kernels.transfer`); for_device sets the CUDA one.
        self.transfer = HostTransfer(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def threads(self):
        """Context for a decode step's own torch ops (see :func:`kvdrive.kernels.cpu.one_torch_thread`)."""
        return cpu.one_torch_thread() if self._one_thread else nullcontext()

    def attention_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype attention computes in for K/V of ``dtype``: float32 for half precision where
        half math is slower than the conversion (the CPU)."""
        return torch.float32 if self._widen_half and dtype in _HALF else dtype

    def step_pages(self, valid, first_page, num_pages: int, sink: int, first_local: int, page_size: int,
                   selectable: bool = True):
        """A step's pages, planned once for every layer: the pages it may choose ``[B, num_pages]``
        bool (after the row's sink, before the local window's first page, holding a real token
        of ``valid`` ``[B, >= num_pages * page_size]``; None unless ``selectable``) and each
        row's sink ``[B, sink]``, its first pages from its ``first_page`` ``[B]`` on (-1 from
        ``first_local`` on)."""
        sinks = first_page[:, None] + torch.arange(sink, device=first_page.device)
        sinks = sinks.masked_fill(sinks >= first_local, -1)
        if not selectable:
            return None, sinks
        page = torch.arange(num_pages, device=valid.device)
        sel = (page[None, :] >= (first_page + sink)[:, None]) & (page[None, :] < first_local)
        sel &= valid[:, : num_pages * page_size].reshape(valid.shape[0], num_pages, page_size).any(dim=2)
        return sel.contiguous(), sinks

    def lowrank_select(self, query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout):
        return ref.lowrank_select(query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout)

    def lowrank_choose(self, query, index, selectable, k, sink, cached):
        """A step's chosen pages from a low-rank ``index`` (a :class:`kvdrive_client.lowrank.LowRankIndex`):
        the ``sink`` pages ``[B, s]``, then :meth:`lowrank_select`'s ``k`` best (-1 where fewer have a
        score), ``[B, H, s + k]``; and the scores of the ``cached`` pages (None: not asked), as
        :meth:`place` takes its priority."""
        pages, scores, cached_scores = self.lowrank_select(query, index.qproj, index.scale, index.scaling, index.codes,
                                                           index.valid, selectable, k, index.page_size, cached,
                                                           index.layout)
        return with_sink(sink, pages.masked_fill(scores == ref.NEG_INF, -1)), cached_scores

    def lowrank_add_page(self, index, keys, valid) -> None:
        """Page ``index.num_pages`` of a low-rank ``index`` (a :class:`kvdrive_client.lowrank.LowRankIndex`
        with room for it): its keys ``[B, H, S, D]`` sketched, quantised and packed into
        ``index.codes``, its mask ``valid`` ``[B, S]`` into ``index.valid``."""
        s = index.page_size
        at = slice(index.num_pages * s, (index.num_pages + 1) * s)
        steps = (torch.matmul(keys.float(), index.kproj.float()) / index.scale[:, :, None, :]).transpose(-1, -2)
        index.codes[:, :, :, at] = ref.pack_lowrank_codes(ref.quantize_lowrank(steps, index.layout), index.layout)
        index.valid[:, at] = valid

    def lowrank_scores(self, query, qproj, scale, scaling, codes, valid, num_pages, page_size, layout):
        t = num_pages * page_size
        unpacked = ref.unpack_lowrank_codes(codes[..., :t], layout)
        return ref.score_lowrank(query, qproj, unpacked, scale, valid[:, :t], page_size, scaling)

    def hierarchical_select(self, query, centroids, assign, q8, scale, selectable, k, candidates, cached):
        return ref.hierarchical_select_int8(query, centroids, assign, q8, scale, selectable, k, candidates, cached)

    def place(self, pages, page_slot, slot_page, last_used, prio, head_capacity, step):
        return ref.place(pages, page_slot, slot_page, last_used, prio, head_capacity, step)

    def attended_valid(self, valid, chosen, page_size, local_start, t, heads):
        return ref.attended_valid(valid, chosen, page_size, local_start, t, heads)

    def land(self, cache_k, cache_v, rows, kv) -> None:
        """Fetched pages ``kv`` ``[n, 2, S, D]`` (K, V) into rows ``rows`` ``[n]`` of the device cache
        ``cache_k``/``cache_v`` ``[B, H, C, S, D]`` viewed as ``[B*H*C, S, D]``."""
        for i, cache in enumerate((cache_k, cache_v)):
            cache.view(-1, *cache.shape[3:]).index_copy_(0, rows, kv[:, i].to(cache.dtype))

    def append(self, window: LocalWindow, key: torch.Tensor, value: torch.Tensor) -> None:
        """One token's ``key``/``value`` ``[B, H, D]`` (or ``[B, H, 1, D]``) into the slot of
        position ``window.end`` (the caller moves ``end`` on)."""
        slot = window.slot(window.end)
        for ring, token in ((window.k, key), (window.v, value)):
            (ring.select(2, slot) if token.dim() == 3 else ring[:, :, slot : slot + 1]).copy_(token)

    def count_attended(self, valid, counts: torch.Tensor, index: int, context=None) -> None:
        """Add the real attended tokens (``valid``, from :meth:`attended_valid`) to ``counts[index]``
        on the device. Called before attention over ``valid``, which may do the adding. With
        ``context`` (``(tokens, t, index, times)``), also add ``times`` the real tokens among the
        first ``t`` of ``tokens`` ``[B, >= t]`` to ``counts[index]``."""
        counts[index] += valid.sum()
        if context is not None:
            tokens, t, at, times = context
            counts[at] += tokens[:, :t].sum() * times

    def partial(self):
        """State carried from the first part of a two-part attention into the second."""
        raise NotImplementedError(f"{self.name} kernels attend in one pass")

    def attention(self, query, cache_k, cache_v, slots, local_k, local_v, valid, scaling, partial=None):
        """Exact attention over the pages in ``slots`` (-1: none) then the local window:
        ``[B, H, G, D]`` in the attention dtype."""
        if partial is not None:
            raise NotImplementedError(f"{self.name} kernels attend in one pass")
        return ref.sparse_attention(query, cache_k, cache_v, slots, local_k, local_v, valid, scaling,
                                    self.attention_dtype(cache_v.dtype))

    def dense_attention(self, query, keys, values, valid, scaling):
        """Attention over gathered tokens (no pages selected: the local window only)."""
        return ref.decode_attention(query, keys, values, valid, scaling, self.attention_dtype(values.dtype))

    def attend_window(self, query, cache_k, cache_v, slots, window: LocalWindow | None, valid, scaling, partial=None):
        """:meth:`attention` over the pages in ``slots`` then a :class:`LocalWindow` (None: none);
        with ``slots`` None, :meth:`dense_attention` over the window alone."""
        if window is None:
            local_k = local_v = cache_k.new_empty(*cache_k.shape[:2], 0, cache_k.shape[4])
        else:
            local_k, local_v = window.linear()
        if slots is None:
            return self.dense_attention(query, local_k, local_v, valid, scaling)
        return self.attention(query, cache_k, cache_v, slots, local_k, local_v, valid, scaling, partial)


def with_sink(sink: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Each row's sink pages ``[B, s]`` before its picked pages ``[B, H, k]``: ``[B, H, s + k]``."""
    return torch.cat([sink[:, None, :].expand(-1, picked.shape[1], -1), picked], dim=2)


class ReferenceKernels(Kernels):
    """The torch references, forced (``kernels="reference"``) or chosen for a non-CPU device."""


class CpuKernels(Kernels):
    """The compiled (numba) kernels on CPU tensors; the rest stays the torch reference."""

    name = "cpu"
    attends_in_parts = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, one_thread=True, widen_half=True)

    def lowrank_select(self, query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout):
        return cpu.lowrank_select(query, qproj, scale, scaling, codes, valid, selectable, k, page_size, cached, layout)

    def lowrank_choose(self, query, index, selectable, k, sink, cached):
        return cpu.lowrank_choose(query, index, selectable, k, sink, cached)

    def lowrank_scores(self, query, qproj, scale, scaling, codes, valid, num_pages, page_size, layout):
        return cpu.lowrank_scores(query, qproj, scale, scaling, codes, valid, num_pages, page_size, layout)

    def hierarchical_select(self, query, centroids, assign, q8, scale, selectable, k, candidates, cached):
        return cpu.hierarchical_select(query, centroids, assign, q8, scale, selectable.contiguous(), k, candidates,
                                       None if cached is None else cached.contiguous())

    def place(self, pages, page_slot, slot_page, last_used, prio, head_capacity, step):
        return cpu.place(pages, page_slot, slot_page, last_used, prio, head_capacity, step)

    def attended_valid(self, valid, chosen, page_size, local_start, t, heads):
        if chosen is None:
            return ref.attended_valid(valid, chosen, page_size, local_start, t, heads)
        return cpu.attended_valid(valid, chosen, page_size, local_start, t)

    def partial(self):
        return cpu.PartialAttention()

    def attention(self, query, cache_k, cache_v, slots, local_k, local_v, valid, scaling, partial=None):
        return cpu.sparse_attention(query, cache_k, cache_v, slots, local_k, local_v, valid, scaling, partial)
