"""A synthetic attention-only decode workload with a real model's selection locality.

The decode benchmark drives :class:`~kvdrive_client.engine.SparseKV` with
Llama-3-8B's attention shape (8 KV heads, 32 query heads, head dim 128, fp16) at
long context without running a model. What a sparse-attention system's costs
depend on is *which* pages each step selects and how much that set changes from
one step to the next (it sets the device cache's hit rate and so the store
traffic), so the workload reproduces that: the mean **previous-step selection
overlap** (per row, layer and KV head, the fraction of a step's top-k pages that
were also in the previous step's top-k) is set by one parameter, ``alpha``, and
:func:`calibrate_alpha` finds the ``alpha`` that matches a value measured on a
real model.

Structure, per (row, layer, KV head):

- ``num_topics`` orthonormal *topic* directions (and one more for the sink).
- Prompt keys: the context is cut into runs of pages (geometric lengths, mean
  ``mean_run_pages``); each run takes a random topic. A key is its topic's centre
  plus isotropic noise, so pages differ in relevance by topic and, within a topic,
  by their noise. The first ``sink_tokens`` keys sit on the sink direction, which
  every query also points at (an attention sink). Values are standard normal.
- Queries: a latent vector ``z`` over the topics follows an AR(1) walk,
  ``z_t = alpha z_{t-1} + sqrt(1 - alpha^2) eps_t`` (stationary, unit variance),
  and the query is the topic directions weighted by ``z``: it prefers the topics
  whose ``z`` is largest, and keeps preferring them for about ``1 / (1 - alpha)``
  steps. The query heads of one KV head add small fixed offsets to ``z``. The last
  ``obs_window`` prompt tokens' queries are the walk's states before step 0.
- Decode tokens: the key of a new token is a centre of a random topic (one topic
  per page) plus noise.

Every random draw comes from a ``torch.Generator`` seeded by (seed, what, layer,
row[, step]), so a row is the same whatever the batch size, everything is
reproducible, and keys never depend on ``alpha`` (calibration reuses them).
Prompt keys are generated per layer on demand (:meth:`SyntheticAttention.prefill_kv`):
one layer at 32K tokens, batch 4 is 256 MiB of keys and as much of values.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import torch

from kvdrive.kernels import reference as ref
from kvdrive_client.config import AttachConfig
from kvdrive_client.selectors import IndexKind, Selector, make_selector
from kvdrive_client.session import ModelShape

DESCRIPTION = (
    "Synthetic attention-only decode workload (Llama-3-8B attention shape: 8 KV heads, 32 query heads, "
    "head dim 128, fp16). Keys, values and queries are synthetic, with the step-to-step overlap of the "
    "selected pages calibrated to a real model; no model runs and no tokens are produced. It measures "
    "system costs only (selection, device cache, store traffic, attention time), not output quality."
)

# Key geometry, in units where key noise has unit variance per dimension (real
# post-RoPE keys have per-dimension spreads of about that order). A topic centre of
# norm 8 against token noise of norm ~11 leaves a 16-token page's mean (noise norm
# ~2.8) clearly on its topic.
TOPIC_NORM = 8.0
KEY_NOISE = 1.0
SINK_NORM = 16.0
# Query geometry: norm ~QUERY_GAIN; the best topic's tokens score ~4 logits above an
# average token, and the sink ~11, so attention is peaked but not one-hot.
QUERY_GAIN = 16.0
SINK_GAIN = 8.0
GROUP_SPREAD = 0.35  # std of a query head's offset from its KV head's latent
ALPHA_MAX = 0.9999


def _generator(seed: int, *parts) -> torch.Generator:
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _orthonormal(x: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``[..., D, n]`` (n <= D).

    Not ``torch.linalg.qr``: LAPACK's threads stall for ~0.4 s a call on a busy CPU,
    and a few dozen columns need nothing better.
    """
    cols: list[torch.Tensor] = []
    for j in range(x.shape[-1]):
        v = x[..., j]
        for u in cols:
            v = v - (v * u).sum(dim=-1, keepdim=True) * u
        cols.append(v / v.norm(dim=-1, keepdim=True))
    return torch.stack(cols, dim=-1)


@dataclass(frozen=True)
class SyntheticAttention:
    """The workload's shape and randomness; methods generate its tensors on demand.

    num_layers, batch, context_tokens: prompt length per row (whole pages).
    alpha: step-to-step correlation of each query's latent, in [0, 1); higher alpha,
        higher selection overlap between consecutive steps.
    num_topics: topic directions per (row, layer, KV head), at most head_dim - 1.
    mean_run_pages: mean length in pages of a run of one topic in the prompt.
    sink_tokens: first tokens with sink keys; obs_window: prompt queries returned
        by :meth:`prefill_kv` (the last tokens').
    """

    num_layers: int
    batch: int
    context_tokens: int
    num_kv_heads: int = 8
    num_q_heads: int = 32
    head_dim: int = 128
    dtype: torch.dtype = torch.float16
    page_size: int = 16
    seed: int = 0
    alpha: float = 0.9
    num_topics: int = 32
    mean_run_pages: float = 4.0
    sink_tokens: int = 4
    obs_window: int = 32
    # Per layer: topic bases, group offsets and the last latent state (step, z);
    # small, and not part of the configuration.
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "batch", "num_kv_heads", "num_q_heads", "head_dim", "page_size", "obs_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.context_tokens < self.page_size or self.context_tokens % self.page_size:
            raise ValueError(f"context_tokens ({self.context_tokens}) must be a positive multiple of page_size ({self.page_size})")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}")
        if not 1 <= self.num_topics < self.head_dim:
            raise ValueError(f"num_topics must be in 1..head_dim-1 ({self.head_dim - 1}), got {self.num_topics}")
        if self.mean_run_pages < 1:
            raise ValueError(f"mean_run_pages must be >= 1, got {self.mean_run_pages}")
        if not 0 <= self.sink_tokens <= self.context_tokens:
            raise ValueError(f"sink_tokens must be in 0..context_tokens, got {self.sink_tokens}")
        if self.obs_window > self.context_tokens:
            raise ValueError(f"obs_window ({self.obs_window}) must not exceed context_tokens ({self.context_tokens})")
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {self.dtype}")

    @classmethod
    def llama3_8b(cls, num_layers: int = 32, batch: int = 4, context_tokens: int = 32768, **options) -> "SyntheticAttention":
        return cls(num_layers, batch, context_tokens, num_kv_heads=8, num_q_heads=32, head_dim=128,
                   dtype=torch.float16, **options)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_pages(self) -> int:
        return self.context_tokens // self.page_size

    @property
    def shape(self) -> ModelShape:
        """The model shape KVDrive serves (:class:`kvdrive_client.engine.SparseKV`'s first argument)."""
        return ModelShape(self.num_layers, self.num_kv_heads, self.num_q_heads, self.head_dim, self.dtype, self.scaling)

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5

    # ------------------------------------------------------------ per-layer constants

    def _layer(self, layer: int) -> dict:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in 0..{self.num_layers - 1}, got {layer}")
        state = self._cache.get(layer)
        if state is None:
            h, g, c, d = self.num_kv_heads, self.group, self.num_topics, self.head_dim
            bases, offsets = [], []
            for row in range(self.batch):
                gen = _generator(self.seed, "basis", layer, row)
                # Orthonormal columns: topics 0..c-1, then the sink direction.
                bases.append(_orthonormal(torch.randn(h, d, c + 1, generator=gen)))
                offsets.append(GROUP_SPREAD * torch.randn(h, g, c, generator=gen))
            state = {"basis": torch.stack(bases), "offsets": torch.stack(offsets), "latent": None}
            self._cache[layer] = state
        return state

    # ------------------------------------------------------------ queries

    def _latent(self, layer: int, index: int) -> torch.Tensor:
        """The latent ``[B, H, topics]`` at walk index ``index`` (-obs_window is the first)."""
        state = self._layer(layer)
        start = -self.obs_window
        if index < start:
            raise ValueError(f"step must be >= {start}, got {index}")
        cached = state["latent"]
        if cached is not None and cached[0] <= index:
            at, z = cached
        else:
            at = start
            z = self._per_row_normal("latent0", layer)
        keep, fresh = self.alpha, math.sqrt(1.0 - self.alpha**2)
        while at < index:
            at += 1
            z = keep * z + fresh * self._per_row_normal("latent", layer, at)
        state["latent"] = (at, z)
        return z

    def _per_row_normal(self, what: str, layer: int, *parts) -> torch.Tensor:
        """``[B, H, topics]`` standard normal, each row from its own seeded generator."""
        h, c = self.num_kv_heads, self.num_topics
        return torch.stack([torch.randn(h, c, generator=_generator(self.seed, what, layer, row, *parts))
                            for row in range(self.batch)])

    def _queries(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, Hq, D]`` (float32) for latents ``z`` ``[B, H, topics]``."""
        state = self._layer(layer)
        basis, offsets = state["basis"], state["offsets"]
        c = self.num_topics
        weights = (z[:, :, None] + offsets) * (QUERY_GAIN / math.sqrt(c))  # [B, H, G, c]
        q = torch.matmul(weights, basis[..., :c].transpose(-1, -2)) + SINK_GAIN * basis[:, :, None, :, c]
        return q.reshape(self.batch, self.num_q_heads, self.head_dim)

    # ------------------------------------------------------------ keys and values

    def _page_topics(self, num_pages: int, gen: torch.Generator) -> torch.Tensor:
        """Topic of every prompt page ``[H, P]``: runs of geometric length with random topics."""
        starts = torch.rand(self.num_kv_heads, num_pages, generator=gen) < 1.0 / self.mean_run_pages
        starts[:, 0] = True
        run_topic = torch.randint(self.num_topics, (self.num_kv_heads, num_pages), generator=gen)
        return run_topic.gather(1, starts.long().cumsum(dim=1) - 1)

    def prefill_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's prompt: (queries of the last ``obs_window`` tokens ``[B, Hq, obs, D]``,
        keys ``[B, H, T, D]``, values ``[B, H, T, D]``), all in ``dtype``.

        Also resets the layer's query walk to just before step 0.
        """
        state = self._layer(layer)
        b, h, t, d, s = self.batch, self.num_kv_heads, self.context_tokens, self.head_dim, self.page_size
        p, c = self.num_pages, self.num_topics
        keys = torch.empty(b, h, t, d, dtype=self.dtype)
        values = torch.empty(b, h, t, d, dtype=self.dtype)
        for row in range(b):
            gen = _generator(self.seed, "keys", layer, row)
            topics = self._page_topics(p, gen)
            centres = state["basis"][row].transpose(1, 2)[:, :c] * TOPIC_NORM  # [H, c, D]
            page_centre = centres.gather(1, topics[..., None].expand(-1, -1, d)).to(self.dtype)  # [H, P, D]
            kr = keys[row]
            kr.normal_(0.0, KEY_NOISE, generator=gen)
            kr.view(h, p, s, d).add_(page_centre[:, :, None])
            if self.sink_tokens:
                sink = state["basis"][row][:, :, c] * SINK_NORM  # [H, D]
                kr[:, : self.sink_tokens] = sink[:, None].to(self.dtype)
            values[row].normal_(0.0, 1.0, generator=_generator(self.seed, "values", layer, row))
        state["latent"] = None
        obs = self.obs_window
        zs = [self._latent(layer, i) for i in range(-obs, 0)]
        query = torch.stack([self._queries(layer, z) for z in zs], dim=2)  # [B, Hq, obs, D]
        return query.to(self.dtype), keys, values

    def step(self, step_index: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode step ``step_index`` (0 first) of ``layer``: (q ``[B, Hq, D]``, new key and value ``[B, H, D]``).

        Deterministic for a seed; in-order calls cost O(1), others replay the walk.
        """
        if step_index < 0:
            raise ValueError(f"step_index must be >= 0, got {step_index}")
        state = self._layer(layer)
        q = self._queries(layer, self._latent(layer, step_index))
        h, d, c = self.num_kv_heads, self.head_dim, self.num_topics
        page = (self.context_tokens + step_index) // self.page_size
        keys, values = [], []
        for row in range(self.batch):
            topic = torch.randint(c, (h,), generator=_generator(self.seed, "decode-topic", layer, row, page))
            gen = _generator(self.seed, "decode", layer, row, step_index)
            centre = state["basis"][row][torch.arange(h), :, topic] * TOPIC_NORM  # [H, D]
            keys.append(centre + KEY_NOISE * torch.randn(h, d, generator=gen))
            values.append(torch.randn(h, d, generator=gen))
        return q.to(self.dtype), torch.stack(keys).to(self.dtype), torch.stack(values).to(self.dtype)


# ------------------------------------------------------------ selection locality


def selection_overlap(selected_prev: torch.Tensor, selected_now: torch.Tensor) -> float:
    """Mean over streams of |now ∩ prev| / |now| for page sets ``[..., k]`` (-1 = none).

    Streams that select nothing now are left out; 0.0 when none selects anything.
    """
    if selected_prev.shape[:-1] != selected_now.shape[:-1]:
        raise ValueError(f"stream shapes differ: {tuple(selected_prev.shape)} vs {tuple(selected_now.shape)}")
    now_valid = selected_now >= 0
    hit = (selected_now[..., :, None] == selected_prev[..., None, :]) & (selected_prev[..., None, :] >= 0)
    hits = (hit.any(dim=-1) & now_valid).sum(dim=-1)
    counts = now_valid.sum(dim=-1)
    live = counts > 0
    if not bool(live.any()):
        return 0.0
    return float((hits[live].float() / counts[live].float()).mean())


class OverlapProbe:
    """Selectors over the first ``num_layers`` layers' prompt keys, to measure overlap for any alpha.

    Keys do not depend on alpha, so one probe serves a whole calibration. Pages
    selectable as in KVDrive decode with default options: past the sink page(s), before
    the local window; k pages per step from ``budget`` (a fraction or a token count).
    Decode tokens are not indexed: over a few dozen steps they add a page or two.
    """

    def __init__(self, workload: SyntheticAttention, budget: float = 0.0625, index_kind: IndexKind = IndexKind.MEAN_KEY,
                 num_layers: int = 1) -> None:
        if not 1 <= num_layers <= workload.num_layers:
            raise ValueError(f"num_layers must be in 1..{workload.num_layers}, got {num_layers}")
        w = workload
        cfg = AttachConfig(budget=budget, page_size=w.page_size, sink_tokens=0,
                           local_tokens=max(w.page_size, AttachConfig.local_tokens))
        sink_pages = math.ceil(w.sink_tokens / w.page_size)
        first_local = (w.context_tokens - cfg.local_tokens) // w.page_size
        if first_local - sink_pages < 1:
            raise ValueError(f"context_tokens ({w.context_tokens}) leaves no selectable page between sink and local window")
        self.workload = w
        self.k = cfg.pages_to_select(first_local - sink_pages)
        self.selectable = torch.zeros(w.batch, w.num_pages, dtype=torch.bool)
        self.selectable[:, sink_pages:first_local] = True
        valid = torch.ones(w.batch, w.context_tokens, dtype=torch.bool)
        self.selectors: list[Selector] = []
        for layer in range(num_layers):
            query, keys, _ = w.prefill_kv(layer)
            sel = make_selector(index_kind, w.page_size, w.scaling)
            sel.build(keys, valid, query.reshape(w.batch, w.num_kv_heads, w.group, query.shape[2], w.head_dim))
            self.selectors.append(sel)
            del keys

    @property
    def budget_fraction(self) -> float:
        return self.k / int(self.selectable[0].sum())

    def select(self, workload: SyntheticAttention, step_index: int, layer: int) -> torch.Tensor:
        w = workload
        q, _, _ = w.step(step_index, layer)
        q = q.reshape(w.batch, w.num_kv_heads, w.group, w.head_dim)
        pages, scores = self.selectors[layer].select(q, self.selectable, self.k)
        return pages.masked_fill(scores == ref.NEG_INF, -1)

    def overlap(self, alpha: float | None = None, steps: int = 32) -> float:
        """Mean previous-step overlap over ``steps`` decode steps (steps - 1 transitions) and all probed layers."""
        if steps < 2:
            raise ValueError(f"steps must be >= 2 (overlap compares consecutive steps), got {steps}")
        w = self.workload if alpha is None else replace(self.workload, alpha=alpha)
        values = []
        for layer in range(len(self.selectors)):
            prev = self.select(w, 0, layer)
            for i in range(1, steps):
                now = self.select(w, i, layer)
                values.append(selection_overlap(prev, now))
                prev = now
        return sum(values) / len(values)


def measure_overlap(workload: SyntheticAttention, steps: int = 32, budget: float = 0.0625,
                    index_kind: IndexKind = IndexKind.MEAN_KEY, num_layers: int = 1) -> float:
    """Mean previous-step selection overlap of ``workload`` over its first ``num_layers`` layers."""
    return OverlapProbe(workload, budget, index_kind, num_layers).overlap(steps=steps)


# ------------------------------------------------------------ calibration


@dataclass(frozen=True)
class Calibration:
    """alpha, the overlap it gives on the requested config (1 layer) and on the proxy;
    ``recalibrated`` when the proxy's alpha missed on the real config and was refined there."""

    alpha: float
    overlap: float
    proxy_overlap: float
    recalibrated: bool


def _bisect(probe: OverlapProbe, target: float, steps: int, tol: float, iterations: int = 24) -> tuple[float, float]:
    """alpha with overlap within ``tol`` of ``target`` (or the closest found).

    Bisects u = -log10(1 - alpha): overlap climbs steeply as alpha nears 1, and is
    closer to even in u.
    """
    u_max = -math.log10(1.0 - ALPHA_MAX)

    def at(u: float) -> tuple[float, float]:
        alpha = 1.0 - 10.0**-u
        return alpha, probe.overlap(alpha, steps)

    lo, hi = at(0.0), at(u_max)
    if not lo[1] - tol <= target <= hi[1] + tol:
        raise ValueError(f"target overlap {target} is outside what this workload reaches ({lo[1]:.3f} at alpha 0, "
                         f"{hi[1]:.3f} at alpha {ALPHA_MAX}); change the budget or num_topics")
    best = min((lo, hi), key=lambda r: abs(r[1] - target))
    u_lo, u_hi = 0.0, u_max
    for _ in range(iterations):
        if abs(best[1] - target) <= tol:
            break
        u = 0.5 * (u_lo + u_hi)
        mid = at(u)
        if abs(mid[1] - target) < abs(best[1] - target):
            best = mid
        if mid[1] < target:
            u_lo = u
        else:
            u_hi = u
    return best


def calibrate_alpha(target_overlap: float, base_config: SyntheticAttention, steps: int = 32, tol: float = 0.02,
                    budget: float = 0.0625, index_kind: IndexKind = IndexKind.MEAN_KEY,
                    proxy_tokens: int = 8192, proxy_batch: int = 2) -> Calibration:
    """The alpha whose previous-step overlap is ``target_overlap`` (within ``tol``) on ``base_config``.

    Bisection runs on a small proxy (1 layer, at most ``proxy_tokens`` tokens and
    ``proxy_batch`` rows, the same budget fraction), then the result is measured on
    one layer of ``base_config`` itself; if that misses by more than ``tol``, the
    bisection is redone there.
    """
    if not 0.0 < target_overlap < 1.0:
        raise ValueError(f"target_overlap must be in (0, 1), got {target_overlap}")
    if tol <= 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    full = OverlapProbe(base_config, budget, index_kind)
    proxy_cfg = replace(base_config, num_layers=1, batch=min(base_config.batch, proxy_batch),
                        context_tokens=min(base_config.context_tokens, proxy_tokens))
    proxy = OverlapProbe(proxy_cfg, full.budget_fraction, index_kind)
    alpha, proxy_overlap = _bisect(proxy, target_overlap, steps, tol)
    overlap = full.overlap(alpha, steps)
    recalibrated = abs(overlap - target_overlap) > tol
    if recalibrated:
        alpha, overlap = _bisect(full, target_overlap, steps, tol)
    return Calibration(alpha, overlap, proxy_overlap, recalibrated)
