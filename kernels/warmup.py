"""Compiling the CPU kernels before a decode needs them.

numba compiles a kernel the first time it is called with new argument types and keeps
the machine code in its on-disk cache (:mod:`kvdrive.protocol.jit_cache`),
so each kernel compiles once per machine. Left to the decode, that first compile lands
in the first steps: SmolLM2's first generate() on a 2-core host spent about 80 s in it
(1.7 s per step of selection against 37 ms once compiled), with nothing said.

:func:`warm_up` calls every kernel of the CPU decode path once, on tiny inputs of the
argument types a real decode passes, so that the compile, or on later runs the load
from the cache, happens up front and is logged. Those types, read from a decode's
dispatchers: queries, projections and scales in float32 whatever the model's dtype;
int8 codes and page means; int64 pages and slots; bool masks; K/V in float32, or
fp16/bf16 K/V as their uint16 bits (one compiled version serves both).

The low-rank kernels compile one pair of entry points per kind of sketch layout
(:func:`kvdrive.kernels.cpu.lowrank_fused.is_fused`): the fused layout's, and the passes of
every other. A caller that names its ``layouts`` compiles only the kinds they need; one that
does not gets both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvdrive.kernels import cpu
from kvdrive.kernels import reference as ref
from kvdrive.kernels.cpu import lowrank
from kvdrive.kernels.cpu.lowrank_fused import is_fused

log = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *_HALF)
#: The index kinds (``kvdrive_client.selectors.IndexKind`` values) whose selection is compiled;
#: the others select with torch ops.
INDEXES = ("lowrank", "hierarchical")

# Tiny shapes: every kernel's loops run, none of its work matters.
_B, _H, _G, _D, _P, _S, _K = 1, 2, 2, 8, 4, 4, 2
# The default sketch at head dim 64, the layout of the fused logit pass, and one of the others (the passes).
_FUSED_LAYOUT = ref.SketchLayout(27, 1, 12)
_PASSES_LAYOUT = ref.SketchLayout(8, 1, 4)


@dataclass(frozen=True)
class KernelProgress:
    """One kernel of a :func:`warm_up`: reported before it runs (``seconds`` None) and after."""

    kernel: str
    index: int  # 1-based
    total: int
    seconds: float | None = None
    compiled: bool = False  # after: compiled here (else loaded from the cache, or already loaded)

    def __str__(self) -> str:
        if self.seconds is None:
            return f"kernel {self.index}/{self.total}: {self.kernel} ..."
        how = "compiled" if self.compiled else "ready"
        return f"kernel {self.index}/{self.total}: {self.kernel} {how} in {self.seconds:.1f} s"


@dataclass(frozen=True)
class WarmUpReport:
    """What :func:`warm_up` did: kernels compiled here, loaded from the cache, and the time it took."""

    compiled: tuple[str, ...]
    loaded: tuple[str, ...]
    seconds: float
    cache_dir: str | None  # where numba keeps them (None: numba found no writable cache directory)

    @property
    def summary(self) -> str:
        if self.compiled:
            line = (f"compiled {_kernels(len(self.compiled))} in {self.seconds:.1f} s (first run on this machine; "
                    f"cached in {self.cache_dir or 'no cache directory: every process compiles them'})")
            return line + (f"; {len(self.loaded)} more loaded from the cache" if self.loaded else "")
        if self.loaded:
            return f"loaded {_kernels(len(self.loaded))} from the cache in {self.seconds:.1f} s ({self.cache_dir})"
        return "the CPU kernels were already loaded in this process"


def _kernels(n: int) -> str:
    return f"{n} CPU kernel{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class _Case:
    name: str
    dispatcher: object  # the numba dispatcher the case's wrapper calls
    run: Callable[[], object]


def _lowrank_inputs(layout: ref.SketchLayout):
    g = torch.Generator().manual_seed(0)
    rows, r = layout.rows, layout.rank  # reference.pack_lowrank_codes
    # The query projection in fp16, as the low-rank index keeps it (the kernels take its bits).
    return (torch.randn(_B, _H, _G, _D, generator=g), torch.randn(_B, _H, _D, r, generator=g).half(),
            torch.rand(_B, _H, r, generator=g) + 0.5, 0.125,
            torch.randint(-8, 8, (_B, _H, rows, _P * _S), dtype=torch.int8, generator=g),
            torch.ones(_B, _P * _S, dtype=torch.bool))


def _cached_pages() -> torch.Tensor:
    return torch.tensor([0, -1]).repeat(_B, _H, 1)  # [B, H, 2] int64: one cached page, one empty slot


def _lowrank_select(layout: ref.SketchLayout):
    def run():
        q, qproj, scale, scaling, codes, valid = _lowrank_inputs(layout)
        selectable = torch.ones(_B, _P, dtype=torch.bool)
        return cpu.lowrank_select(q, qproj, scale, scaling, codes, valid, selectable, _K, _S, _cached_pages(), layout)
    return run


def _lowrank_scores(layout: ref.SketchLayout):
    def run():
        q, qproj, scale, scaling, codes, valid = _lowrank_inputs(layout)
        return cpu.lowrank_scores(q, qproj, scale, scaling, codes, valid, _P, _S, layout)
    return run


def _lowrank_cases(layouts: Iterable[ref.SketchLayout] | None) -> list[_Case]:
    """The low-rank kernels of each kind of layout among ``layouts`` (None: both kinds)."""
    kinds = {True, False} if layouts is None else {is_fused(x.rank, x.int8, x.int2) for x in layouts}
    cases = []
    if True in kinds:
        cases += [_Case("lowrank_select (fused layout)", lowrank._lowrank_select_fused, _lowrank_select(_FUSED_LAYOUT)),
                  _Case("lowrank_scores (fused layout)", lowrank._lowrank_scores_fused, _lowrank_scores(_FUSED_LAYOUT))]
    if False in kinds:
        cases += [_Case("lowrank_select (other layouts)", lowrank._lowrank_select_passes,
                        _lowrank_select(_PASSES_LAYOUT)),
                  _Case("lowrank_scores (other layouts)", lowrank._lowrank_scores_passes,
                        _lowrank_scores(_PASSES_LAYOUT))]
    return cases


def _hierarchical_select():
    g = torch.Generator().manual_seed(0)
    centroids = torch.randn(_B, _H, 2, _D, generator=g)
    assign = torch.tensor([0, 0, 1, 1], dtype=torch.int32).repeat(_B, _H, 1)
    q8 = torch.randint(-127, 128, (_B, _H, _P, _D), dtype=torch.int8, generator=g)
    scale = torch.rand(_B, _H, _P, generator=g)
    selectable = torch.ones(_B, _P, dtype=torch.bool)
    return cpu.hierarchical_select(torch.randn(_B, _H, _G, _D, generator=g), centroids, assign, q8, scale, selectable,
                                   _K, 2 * _K, _cached_pages())


def _place():
    capacity = 3
    pages = torch.tensor([1, 2]).repeat(_B, _H, 1)
    page_slot = torch.full((_B, _H, 64), -1, dtype=torch.long)
    slot_page = torch.full((_B, _H, capacity), -1, dtype=torch.long)
    last_used = torch.zeros(_B, _H, capacity, dtype=torch.long)
    prio = torch.zeros(_B, _H, capacity)
    return cpu.place(pages, page_slot, slot_page, last_used, prio, torch.tensor([capacity] * _H), 1)


def _attended_valid():
    return cpu.attended_valid(torch.ones(_B, _P * _S, dtype=torch.bool), torch.tensor([0, -1]).repeat(_B, _H, 1), _S,
                              (_P - 1) * _S, _P * _S)


def _sparse_attention(dtype: torch.dtype):
    def run():
        g = torch.Generator().manual_seed(0)
        cache_k = torch.randn(_B, _H, 3, _S, _D, generator=g).to(dtype)
        local_k = torch.randn(_B, _H, _S, _D, generator=g).to(dtype)
        slots = torch.tensor([0, -1]).repeat(_B, _H, 1)
        valid = torch.ones(_B, _H, _K * _S + _S, dtype=torch.bool)
        query = torch.randn(_B, _H, _G, _D, generator=g)
        partial = cpu.PartialAttention()  # both calls of a two-part attention: the second merges
        for _ in range(2):
            out = cpu.sparse_attention(query, cache_k, cache_k, slots, local_k, local_k, valid, 0.125, partial)
        return out
    return run


def _cases(dtypes: Iterable[torch.dtype], indexes: Iterable[str],
           layouts: Iterable[ref.SketchLayout] | None = None) -> list[_Case]:
    dtypes, indexes = set(dtypes), set(indexes)
    wrong = dtypes - set(DTYPES)
    if wrong:
        raise ValueError(f"the compiled CPU kernels read K/V as {', '.join(map(str, DTYPES))}, not "
                         f"{', '.join(map(str, wrong))}: cast the model to one of them, or use kernels='reference'")
    cases = []
    if "lowrank" in indexes:
        cases += _lowrank_cases(layouts)
    if "hierarchical" in indexes:
        cases.append(_Case("hierarchical_select", cpu._hierarchical_select, _hierarchical_select))
    cases += [_Case("place", cpu._place, _place), _Case("attended_valid", cpu._attended_valid, _attended_valid)]
    if torch.float32 in dtypes:
        cases.append(_Case("sparse_attention (float32 K/V)", cpu._sparse_attention, _sparse_attention(torch.float32)))
    if dtypes & set(_HALF):
        cases.append(_Case("sparse_attention (fp16/bf16 K/V)", cpu._sparse_attention,
                           _sparse_attention(torch.bfloat16)))
    return cases


def warm_up(dtypes: Iterable[torch.dtype] = (torch.float32,), indexes: Iterable[str] = INDEXES,
            progress: Callable[[KernelProgress], None] | None = None,
            layouts: Iterable[ref.SketchLayout] | None = None) -> WarmUpReport:
    """Compile (or load from the cache) the CPU kernels a decode of K/V in ``dtypes`` with the
    ``indexes`` (:data:`INDEXES`; other index kinds add nothing) calls, so that none compiles mid-decode.
    ``layouts``: the low-rank index's sketch layouts the decode uses (None, not known: the
    kernels of every layout; the fused layout's alone compile in under half the time of both).

    Logs one INFO line per kernel compiled and one for the whole; ``progress`` gets a
    :class:`KernelProgress` before and after each kernel. Kernels already loaded in this
    process cost microseconds: calling it again is cheap.
    """
    cases = _cases(dtypes, indexes, layouts)
    compiled, loaded = [], []
    t0 = time.perf_counter()
    with cpu.one_torch_thread():
        for i, case in enumerate(cases, 1):
            stats = case.dispatcher.stats
            hits, misses = sum(stats.cache_hits.values()), sum(stats.cache_misses.values())
            if progress:
                progress(KernelProgress(case.name, i, len(cases)))
            t = time.perf_counter()
            case.run()
            seconds = time.perf_counter() - t
            was_compiled = sum(stats.cache_misses.values()) > misses
            if was_compiled:
                compiled.append(case.name)
                log.info("compiled the %s kernel in %.1f s (%d/%d)", case.name, seconds, i, len(cases))
            elif sum(stats.cache_hits.values()) > hits:
                loaded.append(case.name)
            if progress:
                progress(KernelProgress(case.name, i, len(cases), seconds, was_compiled))
    report = WarmUpReport(tuple(compiled), tuple(loaded), time.perf_counter() - t0, cpu._place.stats.cache_path)
    if compiled or loaded:
        log.info("%s", report.summary)
    return report
