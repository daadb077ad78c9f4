"""Options of attach(): one frozen dataclass, checked on construction."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, replace

from kvdrive.kernels import KERNEL_CHOICES
from kvdrive.kernels.reference import SketchLayout
from kvdrive_client.device_cache import EvictionPolicy
from kvdrive_client.selectors import IndexKind

log = logging.getLogger(__name__)

_UNSET = "unset"  # a deprecated option not given
# Old option names, kept as deprecated aliases: "window" now means the local window only.
_RENAMED = {"window": "cache_multiplier", "windows": "head_multipliers"}


DEFAULT_BUDGET = 0.0625  # the selectable pages attended per step, as a fraction


@dataclass(frozen=True)
class AttachConfig:
    """How KVDrive decodes.

    budget: pages attended per step besides the sink and local window, as a
        fraction of the selectable pages (0 < budget <= 1; 1 attends every page).
    budget_tokens: instead of ``budget``, a fixed count of tokens attended per step
        besides the sink and local window (whole pages: rounded up to a page, at least
        one page), however long the context grows.
    page_size: tokens per page (the unit of selection, caching and storage).
    sink_tokens / local_tokens: always attended: the first tokens and the last ones.
    cache_multiplier: device cache per (layer, KV head) as a multiple of the step's
        selection (the paper's xW), never more than the pages before the local window
        (at budget 1 each page once); 0 keeps no cache (every selected page is fetched
        every step); None calibrates it during the first decode steps (grown while
        fetching takes longer than the hit/miss evaluation). ``cache_bytes`` instead
        sets a total byte budget; ``head_multipliers`` (or a ``profile`` file written by
        ``kvdrive-profile``) sets one multiplier per (layer, KV head). The old names
        ``window`` and ``windows`` still work, with a DeprecationWarning.
    micro_batch: batch rows per pipeline micro-batch; None calibrates it during the
        first decode steps (each candidate size timed on one step, the fastest kept).
    pipeline: overlap selection, hit/miss evaluation, fetching and attention of
        successive micro-batches (off: one stage after another for the whole batch).
    overlap_fetch: attend to the cached pages and the local window while the missed
        pages are fetched, then to the fetched ones, merging the two parts through
        their log-sum-exps (CPU; the result equals one pass up to float rounding).
        Off: attention waits for the fetch and runs in one pass.
    trace: write a Chrome trace JSON of every decode stage here when the session ends.
    obs_window: prompt tokens whose attention scores page importance at prefill.
    index: how pages are chosen: ``lowrank`` (default) keeps every key as a ``rank``-dim
        sketch fitted to the prefill's queries, its ``int8_channels`` leading channels in
        int8, its ``int2_channels`` trailing ones in int2, the rest int4 (None:
        :meth:`lowrank_layout`'s defaults, 11 bytes a token at head dim 64), and
        ranks pages by estimated attention mass; ``hierarchical`` (int8 page means
        under k-means centroids, ``pages_per_cluster``, ``candidate_factor``),
        ``meankey`` and ``quest`` are the cheaper, less exact indexes; ``oracle``
        keeps every key (measurement only).
    reuse: keep each prompt's complete pages in the store under a name derived from
        the model and the tokens; a later generate() on the same prompt loads them
        instead of running prefill over them (also after a daemon restart), all but
        those of the last tokens whose queries the prefill reads (the index's fit,
        ``obs_window``): the reused prompt decodes as the fresh one. A model's
        sliding-window layers get their windows at that point, stored beside the
        pages. Refused for a model whose every layer attends over a sliding window.
    keep: keep the session's own store sequences (decode pages) after generate().
    kernels: which kernels select, place and attend: ``auto`` (the compiled CPU kernels
        on the CPU, the torch references elsewhere), ``cpu`` or ``reference`` (the torch
        references, on any device: slower, for checking the others).
    """

    budget: float = DEFAULT_BUDGET
    budget_tokens: int | None = None
    page_size: int = 16
    sink_tokens: int = 16
    local_tokens: int = 64
    cache_multiplier: float | None = 4.0
    cache_bytes: int | None = None
    head_multipliers: tuple[tuple[float, ...], ...] | None = None
    profile: str | None = None
    micro_batch: int | None = None
    pipeline: bool = True
    overlap_fetch: bool = True
    trace: str | None = None
    index: IndexKind = IndexKind.LOWRANK
    eviction: EvictionPolicy = EvictionPolicy.LOOKAHEAD
    obs_window: int = 32
    pages_per_cluster: int = 8
    candidate_factor: float = 4.0
    rank: int | None = None
    int8_channels: int | None = None
    int2_channels: int | None = None
    namespace: str = "kvdrive"
    keep: bool = False
    reuse: bool = False
    device: str | None = None
    kernels: str = "auto"
    window: float | None | str = _UNSET  # deprecated: cache_multiplier
    windows: tuple | str | None = _UNSET  # deprecated: head_multipliers

    def __post_init__(self) -> None:
        self._take_renamed()
        for name, enum_type in (("index", IndexKind), ("eviction", EvictionPolicy)):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    object.__setattr__(self, name, enum_type(value))
                except ValueError:
                    choices = ", ".join(e.value for e in enum_type)
                    raise ValueError(f"{name}={value!r}: choose one of {choices}") from None
        self._check_budget()
        if not 1 <= self.page_size <= 4096:
            raise ValueError(f"page_size must be in 1..4096, got {self.page_size}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.local_tokens < self.page_size:
            # A page leaves the local window only after it has been written to the store.
            raise ValueError(f"local_tokens ({self.local_tokens}) must be at least page_size ({self.page_size})")
        if self.sink_tokens % self.page_size:
            raise ValueError(f"sink_tokens ({self.sink_tokens}) must be a multiple of page_size ({self.page_size})")
        m = self.cache_multiplier
        if m is not None and m != 0 and not m >= 1:
            raise ValueError(f"cache_multiplier must be 0 (no cache), >= 1 (the cache holds at least one step's "
                             f"selection) or None (calibrate), got {m}")
        if self.head_multipliers is not None:
            object.__setattr__(self, "head_multipliers",
                               tuple(tuple(float(w) for w in layer) for layer in self.head_multipliers))
            if any(not w >= 1 for layer in self.head_multipliers for w in layer):
                raise ValueError("every per-head cache multiplier must be >= 1")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1 or None (calibrate), got {self.micro_batch}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be > 0, got {self.cache_bytes}")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or not 1 <= self.rank <= 4096):
            raise ValueError(f"rank must be a whole number in 1..4096 or None (27/64 of the head dim), "
                             f"got {self.rank!r}")
        for name in ("int8_channels", "int2_channels"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 4096):
                raise ValueError(f"{name} must be a whole number in 0..4096 or None (the default layout), got {n!r}")
        if self.rank is not None and (self.int8_channels or 0) + (self.int2_channels or 0) > self.rank:
            raise ValueError(f"int8_channels + int2_channels ({self.int8_channels} + {self.int2_channels}) exceed "
                             f"rank {self.rank}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r}: choose one of {', '.join(KERNEL_CHOICES)}")
        if self.obs_window < 1:
            raise ValueError(f"obs_window must be >= 1, got {self.obs_window}")

    def _check_budget(self) -> None:
        """``budget`` a fraction in (0, 1], or ``budget_tokens`` a whole count instead of it."""
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise TypeError(f"budget must be a number, a fraction in (0, 1]; got {type(self.budget).__name__} "
                            f"{self.budget!r}")
        if not 0 < self.budget <= 1:
            hint = (f"; for a count of {self.budget:g} tokens per step, give budget_tokens={self.budget:g}"
                    if self.budget > 1 else "")
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget:g}{hint}")
        if self.budget_tokens is not None:
            if self.budget != DEFAULT_BUDGET:
                raise ValueError(f"budget={self.budget:g} and budget_tokens={self.budget_tokens} both given: "
                                 "budget_tokens replaces budget; give one of them")
            if isinstance(self.budget_tokens, bool) or not isinstance(self.budget_tokens, int):
                raise TypeError(f"budget_tokens must be a whole number of tokens, got "
                                f"{type(self.budget_tokens).__name__} {self.budget_tokens!r}")
            if self.budget_tokens < 1:
                raise ValueError(f"budget_tokens must be >= 1, got {self.budget_tokens}")

    def _take_renamed(self) -> None:
        """Move a deprecated option's value to its new name (warning once per construction)."""
        for old, new in _RENAMED.items():
            value = getattr(self, old)
            if isinstance(value, str) and value == _UNSET:
                continue
            warnings.warn(f"AttachConfig({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=4)
            object.__setattr__(self, new, value)
            object.__setattr__(self, old, _UNSET)

    def for_model(self, num_layers: int, num_kv_heads: int) -> "AttachConfig":
        """This config with ``profile`` loaded into ``head_multipliers``, both checked against the model's shape."""
        cfg = self
        if self.profile is not None:
            from kvdrive_client.profile import WindowProfile  # noqa: PLC0415 - numpy-only, loaded when used

            prof = WindowProfile.load(self.profile)
            if prof.page_size != self.page_size:
                raise ValueError(f"profile {self.profile} was measured at page_size {prof.page_size}, "
                                 f"not {self.page_size}")
            if prof.budget != self.budget:
                log.warning("profile %s was measured at budget %g; decoding at %g", self.profile, prof.budget, self.budget)
            cfg = replace(self, head_multipliers=prof.windows)
            log.info("per-head cache multipliers from %s: %d layers x %d KV heads, x%g..x%g", self.profile,
                     prof.num_layers, prof.num_kv_heads, min(min(r) for r in prof.windows),
                     max(max(r) for r in prof.windows))
        hm = cfg.head_multipliers
        if hm is not None and (len(hm) != num_layers or any(len(r) != num_kv_heads for r in hm)):
            where = f"profile {self.profile}" if self.profile else "head_multipliers"
            raise ValueError(f"{where} is [{len(hm)} layers][{len(hm[0]) if hm else 0} heads]; "
                             f"the model has {num_layers} layers x {num_kv_heads} KV heads")
        return cfg

    def lowrank_layout(self, head_dim: int) -> SketchLayout:
        """The low-rank index's sketch: ``rank``, ``int8_channels``, ``int2_channels``, each None
        for its default: rank 27/64 of the head dim, its first head_dim/64 channels int8 and
        its last 12/64 of the head dim int2 (13/64 from head dim 256 on; none when ``rank`` is
        given), the rest int4. At head dim 64 that is rank 27 (1 int8, 14 int4, 12 int2
        channels): 11 bytes per token and KV head, 1/23 of an fp16 K+V token; at Gemma 3's 256,
        rank 108 (4 int8, 52 int4, 52 int2 channels), 43 bytes.

        The two fp16 projections of a (row, KV head) grow with the square of the head dim: at
        256 they add 6.75 bytes a token at 16K, and with 44 bytes of codes (12/64 int2) the
        index came to 0.0506 of an fp16 K+V there; four int4 channels more in int2 bring it to
        0.0496. On two licence windows of Gemma 3 at 16K (6.25%) that recalled 0.5681 and
        0.6978 of the attention mass against 0.5688 and 0.6984, dloss -0.0014 and +0.0180
        against -0.0016 and +0.0193, KL 0.0009 and 0.0357 against 0.0009 and 0.0340: within
        the noise of 64 tokens (a rank-106 sketch, as small, did no better). Below 256 the
        projections are at most half as large a share of the K+V, and the codes keep 12/64.

        The bits follow each channel's share of ``q . k``: the first carries so much of it
        that in int4 it cost the most, and the last ones still carry what a copying head
        matches on. Against the former default (rank 22, all int4, also 11 bytes) the share of
        the oracle's attention mass recalled rose from 0.932 to 0.960 on four held-out windows
        of logs, changelogs, tables and manuals at 7K tokens on SmolLM2; a rank-16 or 18 sketch
        with int8 leading channels recalled as much but lost the pages copies read (+0.21
        nats on a log window at 6.25%, against +0.04).
        """
        unit = max(1, head_dim // 64)
        rank = self.rank if self.rank is not None else max(1, head_dim * 27 // 64)
        wide = min(rank, self.int8_channels if self.int8_channels is not None else unit)
        narrow = self.int2_channels if self.int2_channels is not None else (
            head_dim * (13 if head_dim >= 256 else 12) // 64 if self.rank is None else 0)
        return SketchLayout(rank, wide, min(narrow, rank - wide))

    @property
    def sink_pages(self) -> int:
        return self.sink_tokens // self.page_size

    def pages_to_select(self, selectable_pages: int) -> int:
        if selectable_pages <= 0:
            return 0
        if self.budget_tokens is not None:
            return min(selectable_pages, math.ceil(self.budget_tokens / self.page_size))
        return min(selectable_pages, max(1, math.ceil(self.budget * selectable_pages)))
