"""What the decode stages share: the model's shape, per-layer state, the step plan, micro-batches."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvdrive.kernels import Kernels
from kvdrive.kernels.window import LocalWindow
from kvdrive.layout.geometry import Geometry
from kvdrive_client.config import AttachConfig
from kvdrive_client.device_cache import DeviceCache, HostPlacement, Placement
from kvdrive_client.selectors import Selector
from kvdrive_client.timeline import Timeline

TORCH_TO_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype
    scaling: float | None = None  # softmax scale; None: head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.scaling is None:
            self.scaling = self.head_dim**-0.5

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def geometry(self, page_size: int) -> Geometry:
        """The store geometry of this model's (KVDrive-served) layers."""
        return Geometry(self.num_layers, self.num_kv_heads, self.head_dim, TORCH_TO_DTYPE[self.dtype], page_size)

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of one (layer, KV head): its K and V, as stored and cached (one store block)."""
        return Geometry(1, 1, self.head_dim, TORCH_TO_DTYPE[self.dtype], page_size).block_bytes


class Observer:
    """Hooks for measurement tools (fidelity, cache traces); the defaults do nothing.

    Keys are post-RoPE, ``[B, H, T, D]``; ``valid`` marks real (unpadded) tokens. Pages and
    positions count the session's ``shift`` padding tokens first (pages end where the prompt
    does); :meth:`on_prefill_layer` alone gets the model's tokens as it handed them over.
    Register one with :meth:`kvdrive_client.session.Session.add_observer`.
    """

    def on_prefill_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                         mask: torch.Tensor | None) -> None:
        """What a layer's prefill hands KVDrive, before it is indexed: all its K and V, the queries, the mask."""

    def on_prefill(self, layer: int, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """The keys of a layer's complete prefill pages, as they are indexed."""

    def on_page(self, layer: int, page: int, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """A page completed while decoding, as it is indexed."""

    def on_seed(self, layer: int, ranked: torch.Tensor) -> None:
        """Pages between sink and local window, most important first ``[B, H, n]``: the cache is seeded
        with as many of them (after the sink pages) as each head's window holds."""

    def on_select(self, layer: int, step: int, query: torch.Tensor, chosen: torch.Tensor, selectable: torch.Tensor,
                  selector: "Selector") -> None:
        """``chosen`` ``[B, H, k]`` pages (-1 none) picked among ``selectable`` ``[B, P]``."""


class LayerState:
    """One layer's decode state on the compute device."""

    def __init__(self) -> None:
        self.prefill: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V between update() and finish_prefill()
        self.window: LocalWindow | None = None  # the local window: tokens [start, num_tokens), in a ring
        self.num_tokens = 0
        self.num_pages = 0  # complete pages: indexed and (to be) stored
        self.selector: Selector | None = None
        self.cache: DeviceCache | None = None


class DeviceCounts:
    """Figures counted on the compute device, so that counting never waits for it; they reach
    the session's stats with the next copy to the host that a step makes anyway (the
    placement's), or when the stats are read (:meth:`fold`). Main thread only.

    The device keeps running totals (taking them copies them, nothing resets them); the host
    adds what grew since the totals it last saw."""

    NAMES = ("attended_tokens", "context_tokens")

    def __init__(self, device: torch.device) -> None:
        self.values = torch.zeros(len(self.NAMES), dtype=torch.long, device=device)
        self.pending = False
        self._seen = [0] * len(self.NAMES)

    def add_attended(self, kernels: Kernels, valid, context: tuple[torch.Tensor, int, int] | None = None) -> None:
        """Count the real attended tokens of ``valid`` (the kernels' :meth:`~Kernels.attended_valid`),
        before attention over it: the kernels may count while they attend. With ``context``
        (``(tokens, t, times)``), also ``times`` the real tokens among the first ``t`` of ``tokens``."""
        if context is not None:
            tokens, t, times = context
            context = (tokens, t, self.NAMES.index("context_tokens"), times)
        kernels.count_attended(valid, self.values, self.NAMES.index("attended_tokens"), context)
        self.pending = True

    def take(self) -> torch.Tensor | None:
        """The running totals (to copy to the host with something else, at once: the tensor
        counts on), None when nothing was counted since the last take."""
        if not self.pending:
            return None
        self.pending = False
        return self.values

    def add_to(self, stats: Counter, host_values) -> None:
        """Add to ``stats`` what the totals ``host_values`` (a copy of :meth:`take`'s) grew by."""
        for i, (name, v) in enumerate(zip(self.NAMES, host_values)):
            stats[name] += int(v) - self._seen[i]
            self._seen[i] = int(v)

    def fold(self, stats: Counter) -> None:
        """Add what is counted to ``stats`` now (one copy to the host)."""
        taken = self.take()
        if taken is not None:
            self.add_to(stats, taken.tolist())


@dataclass
class Context:
    """The facts and shared records of one session, handed to every stage."""

    cfg: AttachConfig
    shape: ModelShape
    batch: int
    device: torch.device
    kernels: Kernels
    stats: Counter
    timeline: Timeline
    layers: list[LayerState]
    observers: list[Observer] = field(default_factory=list)
    multiplier: float = 1.0  # device cache per (layer, KV head) as a multiple of a step's selection
    step: int = 0
    counts: DeviceCounts | None = None
    first_page: torch.Tensor | None = None  # [B] each row's first page holding a real token (left padding)
    first_pages: list[int] | None = None  # first_page on the host

    def __post_init__(self) -> None:
        self.counts = DeviceCounts(self.device)


@dataclass
class StepPlan:
    """What is the same for every layer of one decode step, built once when the step starts."""

    step: int
    valid: torch.Tensor  # [B, >= t] real (unpadded) tokens
    t: int  # tokens in the context, the new one included
    num_pages: int  # complete pages, the ones this step completes included
    first_local: int  # first page of the local window
    sink: int  # sink pages, always attended
    k: int  # pages selected per (row, KV head) besides the sink: the largest row's k
    selectable: torch.Tensor | None  # [B, num_pages]: pages the step may choose (None when k == 0)
    groups: list[tuple[int, int]]  # micro-batches: row ranges [lo, hi)
    sink_pages: torch.Tensor | None = None  # [B, sink]: each row's first real pages (-1: none)
    beyond: torch.Tensor | None = None  # [B, k] bool: past the row's own k (None: no row's k is below k)

    @property
    def attends_pages(self) -> bool:
        return self.sink + self.k > 0


@dataclass
class MicroBatch:
    """Rows ``[lo, hi)`` of one layer's decode step, carried through select, place, fetch and attend."""

    index: int
    lo: int
    hi: int
    query: torch.Tensor  # [hi - lo, H, G, D]
    lane: str = "main"  # the timeline lane its selection runs on
    chosen: torch.Tensor | None = None  # [b, H, sink + k] pages (-1: none)
    slot_scores: torch.Tensor | None = None  # [b, H, capacity] current scores of the cached pages
    cache: DeviceCache | None = None  # the layer's cache, rows [lo, hi)
    placement: Placement | None = None
    host: HostPlacement | None = None  # the placement, copied to the host
    fetch: object | None = None  # the store get of the misses, in flight
    valid: object = None  # [b, H, attended tokens] bool, or what the kernels take for it (Kernels.attended_valid)
    select_ms: float = 0.0
    place_ms: float = 0.0

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s rows ``[lo, hi)`` (batch-first); ``t`` itself when they are all its rows (no op)."""
        return t if self.lo == 0 and self.hi == t.shape[0] else t[self.lo : self.hi]

    def window(self, window: LocalWindow) -> LocalWindow:
        """A local window's rows ``[lo, hi)``; the window itself when they are all its rows."""
        return window if self.lo == 0 and self.hi == window.k.shape[0] else window.rows(self.lo, self.hi)
