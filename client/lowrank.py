"""The low-rank index: every key as a small sketch fitted to the prefill's queries."""

from __future__ import annotations

import math

import torch

from kvdrive.kernels import Kernels
from kvdrive.kernels import reference as ref
from kvdrive_client.index_kind import IndexKind
from kvdrive_client.selector_base import Selector, _grow


# The default at head dim 64 (AttachConfig.lowrank_layout scales it with the head dim).
DEFAULT_LAYOUT = ref.SketchLayout(27, 1, 12)
DECODE_PAGES = 64  # pages decoding may add before the index first grows


def fitted_layout(requested: ref.SketchLayout, head_dim: int) -> ref.SketchLayout:
    """The layout an index of ``requested`` keeps for keys of ``head_dim``: a head dim below
    the rank keeps the first ``head_dim`` channels, dropping int2 ones first, then int4."""
    r = min(requested.rank, head_dim)
    n8 = min(requested.int8, r)
    n4 = min(requested.int4, r - n8)
    return ref.SketchLayout(r, n8, r - n8 - n4)


class LowRankIndex(Selector):
    """Every key kept as a rank-``rank`` sketch fitted to the queries; pages ranked by estimated mass.

    Fitting, per (row, KV head), at prefill: the second moment of the prompt's last
    ``FIT_QUERIES`` queries ``C = E[q q^T]`` gives ``A = C^(1/2)``; the top ``rank`` eigenvectors ``U`` of
    ``A^T K^T K A`` span the directions that carry most of ``q . k`` for queries like
    those. A key is kept as ``z = U^T A k`` with one scale per channel, a query maps to
    ``U^T A^-1 q``, and ``q . k ~ (U^T A^-1 q) . z``. The channels come in order of the
    share of ``q . k`` they carry, and are stored as ``layout`` says: the leading ones in
    int8, the trailing ones in int2, the rest int4 (:func:`reference.pack_lowrank_codes`;
    a head dim below the rank narrows it from its int2 end). A page's score is the log of its estimated
    share of the softmax mass, summed over the query heads of its KV head
    (:func:`reference.score_lowrank`): the quantity the oracle ranks by. Without prefill
    queries ``A = I``: the keys' own principal directions. :meth:`build` also clusters the
    pages' mean sketches (``pages_per_cluster`` pages per k-means cluster) for the store's
    packing.

    Each channel's scale is its largest ``|z|`` over the prefill over its code range, so
    the keys that stand out most (the ones a copying head looks for) keep their lead
    (scales set by a quantile of ``|z|`` instead lost 0.08 nats on a log window of
    SmolLM2 that copies paths); decode keys beyond the range saturate at the largest code.

    Device memory: ``layout.rows`` bytes per token and KV head (11 for the default at head
    dim 64: 1 + 14/2 + 12/4, against 256 for an fp16 K+V token), one validity byte per
    token, and the two ``D x rank`` projections per (row, KV head) in fp16.
    """

    kind = IndexKind.LOWRANK

    RIDGE = 1e-3  # query moments below this fraction of the largest are lifted to it (A stays invertible)
    FIT_TOKENS = 4096  # keys used to fit the projection (evenly strided when the prompt is longer)
    # Queries whose second moment whitens the fit: the prompt's last ones, which the decode's
    # are most like (under rotary embeddings a query's slow channels turn with its position,
    # so the early prompt's point elsewhere). On SmolLM2 at 7K tokens and a 3.125% budget,
    # the chosen pages' share of the oracle's attention mass rose by 0.01-0.02 on each of the
    # corpus windows tried against a fit to all of them (128 to 1024 did about as well; 2048
    # less); over all 15 corpus windows the worst one's loss went from +0.25 to +0.17 nats
    # at 3.125% and from +0.13 to +0.09 at 6.25%.
    FIT_QUERIES = 512

    def __init__(self, page_size: int, scaling: float, layout: ref.SketchLayout = DEFAULT_LAYOUT,
                 pages_per_cluster: int = 8, kernels: Kernels | None = None) -> None:
        super().__init__(page_size, kernels)
        self.scaling = scaling
        self.requested = layout
        self.pages_per_cluster = pages_per_cluster

    def _fit(self, keys: torch.Tensor, valid: torch.Tensor, query: torch.Tensor | None) -> None:
        b, h, t, d = keys.shape
        r = min(self.requested.rank, d)
        self.layout = fitted_layout(self.requested, d)
        # Row by row, each over its own tokens: its keys from its first page holding a real
        # token on (the padding before it left out), evenly strided by its own length, and its
        # real queries. The fit is an eigendecomposition, which can turn the last bit of a sum
        # into another basis: the same ops on the same tensors make a row's fit the one it
        # gets alone, whatever the rows beside it.
        first = valid.int().argmax(dim=1).tolist() if t else [0] * b
        q_at = t - (query.shape[3] if query is not None else 0)  # the queries sit at the last positions
        kproj, qproj = [], []
        for row in range(b):
            start = first[row] // self.page_size * self.page_size
            stride = max(1, (t - start) // self.FIT_TOKENS)
            q = None
            if query is not None and q_at < t:
                q0 = max(q_at, first[row], t - self.FIT_QUERIES)
                q = (query[row, :, :, q0 - q_at :], valid[row, q0:])
            k = keys[row, :, start::stride].float() * valid[row, start::stride, None]
            kp, qp = self._fit_row(k, q, r)
            kproj.append(kp)
            qproj.append(qp)
        # fp16: it only projects keys, once each (prefill and every new page alike), into integer codes.
        self.kproj = torch.stack(kproj).to(torch.float16).contiguous()  # [B, H, D, R]
        # fp16 too: its rounding (1e-3) is far below the codes'; every kernel widens it itself, a few KiB a call.
        self.qproj = torch.stack(qproj).to(torch.float16).contiguous()

    def _fit_row(self, keys: torch.Tensor, query: tuple[torch.Tensor, torch.Tensor] | None,
                 r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's projections ``[H, D, R]`` for keys and queries, from its keys ``[H, N, D]``
        (float32, padding zeroed) and its queries ``[H, G, Q, D]`` with their mask ``[Q]``."""
        h, _, d = keys.shape
        eye = torch.eye(d, dtype=torch.float32, device=keys.device).expand(h, d, d)
        a = a_inv = eye
        if query is not None:
            q, qv = query[0].float(), query[1].to(torch.float32)[None, None, :, None]
            count = (qv.sum() * q.shape[1]).clamp_min(1.0)
            c = torch.einsum("hgqd,hgqe->hde", q * qv, q) / count
            ev, vec = torch.linalg.eigh(c)
            ev = ev.clamp_min(self.RIDGE * ev[..., -1:].clamp_min(1e-12))
            a = vec @ torch.diag_embed(ev.sqrt()) @ vec.transpose(-1, -2)
            a_inv = vec @ torch.diag_embed(ev.rsqrt()) @ vec.transpose(-1, -2)
        gram = a.transpose(-1, -2) @ (keys.transpose(-1, -2) @ keys) @ a
        _, vec = torch.linalg.eigh(gram + 1e-6 * eye)  # ascending: the last columns lead
        top = vec[..., -r:].flip(-1)
        return a @ top, a_inv @ top

    def _quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Sketches ``[B, H, T, R]`` -> channel-major code rows ``[B, H, rows, T]`` (``self.layout``)."""
        steps = (z / self.scale[:, :, None, :]).transpose(-1, -2)
        return ref.pack_lowrank_codes(ref.quantize_lowrank(steps, self.layout), self.layout)

    def build(self, keys, valid, query=None):
        b, h, t, _ = keys.shape
        s = self.page_size
        p = t // s
        self._fit(keys, valid, query)
        z = torch.matmul(keys.float(), self.kproj.float())  # every prefill token sets the range, pages or not
        z = z * valid[:, None, :, None]
        # One scale per channel: its largest |z| over its code range (see the class).
        levels = self.layout.levels().to(z.device)
        self.scale = (z.abs().amax(dim=2) / levels).clamp_min(1e-6) if t else torch.ones_like(self.kproj[..., 0, :], dtype=torch.float32)
        codes = self._quantize(z[:, :, : p * s])  # padding tokens encode as 0 (never scored)
        # Room for DECODE_PAGES pages more: decoded pages are added in place (the index grows once in a while).
        spare = DECODE_PAGES * s
        self.codes = torch.cat([codes, codes.new_zeros(*codes.shape[:3], spare)], dim=3)
        self.valid = torch.cat([valid[:, : p * s], valid.new_zeros(b, spare)], dim=1)
        self.num_pages = p
        if p == 0:
            return None
        # Cluster ids for the store's packing: k-means of the pages' mean sketches, so pages
        # that score alike for the same queries sit together on the SSD.
        r = z.shape[-1]
        zp = z[:, :, : p * s].reshape(b, h, p, s, r)
        count = valid[:, : p * s].reshape(b, 1, p, s, 1).sum(dim=3).clamp_min(1)
        means = zp.sum(dim=3) / count
        _, assign = ref.kmeans(means.reshape(b * h, p, r), max(1, math.ceil(p / self.pages_per_cluster)))
        return assign.reshape(b, h, p).to(torch.int32)

    def add_page(self, keys, valid):
        n, s = self.num_pages, self.page_size
        self.codes = _grow(self.codes, (n + 1) * s, dim=3)
        self.valid = _grow(self.valid, (n + 1) * s, dim=1, fill=False)
        self.kernels(keys).lowrank_add_page(self, keys, valid)
        self.num_pages += 1

    def scores(self, query):
        return self.kernels(query).lowrank_scores(query, self.qproj, self.scale, self.scaling, self.codes, self.valid,
                                                  self.num_pages, self.page_size, self.layout)

    def select_and_score(self, query, selectable, k, cached):
        return self.kernels(query).lowrank_select(query, self.qproj, self.scale, self.scaling, self.codes, self.valid,
                                                  selectable[:, : self.num_pages], k, self.page_size, cached, self.layout)

    def choose(self, query, selectable, k, sink, cached):
        if selectable.shape[1] != self.num_pages:
            selectable = selectable[:, : self.num_pages]
        return self.kernels(query).lowrank_choose(query, self, selectable, k, sink, cached)

    def select(self, query, selectable, k):
        pages, top, _ = self.select_and_score(query, selectable, k, None)
        return pages, top

    @property
    def index_bytes(self):
        t = self.num_pages * self.page_size
        return sum(x.numel() * x.element_size()
                   for x in (self.codes[..., :t], self.valid[:, :t], self.scale, self.kproj, self.qproj))
