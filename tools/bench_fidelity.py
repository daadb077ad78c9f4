"""``kvdrive-bench fidelity``: how close sparse decoding stays to dense attention, per selector.

A real model (``--model``: SmolLM2-135M by default, or Gemma 3 270M, whose global
layers alone go through KVDrive; float32) reads a context of real text (the Debian
common licenses, or ``--text FILE``), then decodes the next ``--tokens`` tokens of
that text teacher-forced,
once densely and once through KVDrive for every selector and budget:

- oracle (exact attention mass per page), lowrank (KVDrive's default: every key as a
  sketch of 27/64 of the head dim (27 for SmolLM2, 108 for Gemma 3; its first channels
  int8, its last int2, the rest int4: 11 bytes a token at head dim 64; ``--rank``,
  ``--int8-channels`` and ``--int2-channels`` change it) fitted to the prefill's
  queries, pages ranked by estimated mass), hierarchical (clustered int8 page means), meankey (one mean key per page,
  every page scored; ShadowKV-style), quest (per-page key min/max bounds);
- budgets 6.25% and 3.125% of the selectable pages (``--quick``: 6.25% only);
- contexts 2K and 7K tokens for SmolLM2, 16K and 32K (32,640: its 32,768 positions
  less the decode) for Gemma 3 (``--quick``: 2K, 4K);
- ``--windows`` text windows (default 3, ``--quick`` 1): window 0 starts at the text's
  first token and is the one the selectors' settings were chosen on; the others are
  held out, spread evenly so that the last one ends where the text does, and do not
  overlap. A window's contexts all start at its first token.
- ``--corpus`` (:mod:`kvdrive.tools.corpus`: code, reference documentation, tables,
  logs, changelogs found on this machine; ``--corpus DIR`` for one's own): ``--windows``
  windows from each kind of text instead of the licences, all held out; the report
  adds, per selector, budget and context, the worst window beside the mean.
- ``--copy`` (:mod:`kvdrive.tools.copytext`: a table of random records repeated, the same
  records shuffled, a report quoted after other minutes; ``--copy KIND ...`` for some):
  ``--windows`` texts of each kind (seeds 0, 1, ...) generated for each context, all held
  out: the context ends inside the copy, the source about 70% of the context back, and
  every decoded token is a copied one. Dense attention copies them (the report says on
  how many of them its greedy token is the text's), so ``dloss`` is the loss on copied
  tokens a selector's misses cost, and ``top1`` the share of them on which its greedy
  token is dense's; the report adds the worst window and judges the default index's
  lowest ``top1`` per budget. ``keycodes`` (``--selectors``) runs only when named.

Per run: ``recall`` is the exact softmax attention mass (over every key the model
holds at that step) on the chosen pages over the mass on all selectable pages, per
step, layer and KV head (query heads of a group summed), averaged; sink pages and
the local window are attended always and are not selectable. ``dloss`` is the mean
NLL of the decoded tokens minus the dense one (nats), ``kl`` the mean
KL(dense || KVDrive) of the next-token distributions, ``top1`` the fraction of steps
whose argmax agrees with dense. ``index_bytes``: every layer's index at the context
length; ``select_ms``: the session's selection time per decode step (all layers),
from the second step on (the first one compiles kernels on a fresh install). The
selectors of one context and budget decode side by side, one session each, every
step taken by each session in turn (the order reversed every other step), so that a
slow spell of a shared machine falls on all of them alike and their select_ms
compare.

The cache part replays the trace of attach()'s default index, lowrank (hierarchical
when lowrank is not among ``--selectors``), at 6.25% (the pages chosen per step, layer
and KV head, and its scores of every page) through
:mod:`kvdrive_client.cache_sim` with caches of window x k pages (k: pages selected
per step), windows x1, x2, x4, under LOOKAHEAD, LRU and BELADY (optimal) eviction.
Cache-sim caches start as a session's do, seeded with the prefill's most important
pages (as many as fit), and hold selected pages only (sink pages are outside). The cache
part runs on text window 0 only.

The prefill is dense and identical for every run, so it runs once per context: the
keys, values and queries that KVDrive's prefill hook receives are kept and replayed
into each selector's fresh session (and into a DynamicCache for the dense reference).
A context longer than ``--prefill-chunk`` tokens (8192) is prefilled densely in chunks
of that many tokens instead of in one pass (the same keys and queries up to float
rounding: at 8K tokens both gave the same figures; chunks keep a sliding-window
layer's attention to a chunk against its window and the chunk, and the masks to a
chunk's rows).

``--json FILE`` writes ``{"fidelity": [...], "cache": [...]}``: ``fidelity`` has one
row per text window x context x budget x selector with exactly the keys selector,
budget, context, text_window (numbered over the whole run), text_kind ("licences", or the
corpus kind), offset (the window's first token in its text), recall, dloss, kl,
top1, text_top1 (the share of steps whose greedy token is the text's next one),
dense_text_top1 (the same for dense attention), index_bytes, kv_bytes (the full K+V of every layer at the context, in the
model's dtype; of the global layers only, the ones KVDrive stores), select_ms,
cache_bytes (the device cache at the end of the decode); ``cache`` one row per
context x window x policy (selector, budget, context, window, capacity, policy,
hits, lookups, hit_rate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvdrive.kernels import cpu as cpu_kernels
from kvdrive.tools.bench_common import InputError, PrefillSnapshot, TraceObserver, compare, in_turns, teacher_force
from kvdrive.tools.targets import (TARGET_BEST, TARGET_DLOSS_BUDGET, TARGET_INDEX_VS_FP16_KV,
                                   TARGET_INDEX_VS_QUEST, TARGET_LOOKAHEAD_VS_BELADY, TARGET_RECALL_VS_MEANKEY,
                                   TARGET_RECALL_VS_ORACLE, TARGET_SELECT_SPEEDUP, TARGET_SELECT_VS_HIERARCHICAL,
                                   TARGET_COPY_MATCH, TARGET_MEAN_DLOSS, TARGET_WINDOW, TARGET_WORST,
                                   TARGET_WORST_OTHER, DenseTarget, verdict)
from kvdrive.tools import copytext
from kvdrive.tools.copytext import KINDS as COPY_KINDS
from kvdrive.tools.bench_fidelity_options import (DEFAULT_BUDGETS, DEFAULT_TOKENS, DEFAULT_WINDOWS, MODEL_RUNS,
                                                  PREFILL_CHUNK, QUICK_BUDGETS, QUICK_TOKENS, QUICK_WINDOWS)
from kvdrive.tools.text_table import text_table
from kvdrive_client.cache_sim import CachePolicy, Trace, simulate
from kvdrive_client.config import AttachConfig
from kvdrive_client.selectors import IndexKind
from kvdrive_client.session import Observer, Session

PAGE_SIZE = 16
TRACE_BUDGET = 0.0625
WINDOWS = (1, 2, 4)
POLICIES = (CachePolicy.LOOKAHEAD, CachePolicy.LRU, CachePolicy.BELADY)
DRAM = "2G"  # the selectors' sessions side by side hold 5 x 330 MB at 7K in float32: all in DRAM



@dataclass(frozen=True)
class FidelityConfig:
    contexts: tuple[int, ...]
    tokens: int
    budgets: tuple[float, ...]
    selectors: tuple[IndexKind, ...]
    text: Path | None
    threads: int = 1
    # None: the licences (or --text); "": the built-in corpus; else a corpus directory.
    corpus: str | None = None
    copy: tuple[str, ...] | None = None  # copy text kinds (kvdrive.tools.copytext), else None
    windows: int = 1
    model: str = "smollm2"
    prefill_chunk: int = PREFILL_CHUNK
    rank: int | None = None  # lowrank's sketch; None: attach()'s defaults
    int8_channels: int | None = None
    int2_channels: int | None = None

    @property
    def attach_config(self) -> AttachConfig:
        """attach()'s configuration for these runs, apart from each run's budget and index."""
        return AttachConfig(page_size=PAGE_SIZE, rank=self.rank, int8_channels=self.int8_channels,
                            int2_channels=self.int2_channels)

    def __post_init__(self) -> None:
        if self.model not in MODEL_RUNS:
            raise ValueError(f"--model {self.model!r}: choose one of {', '.join(MODEL_RUNS)}")
        if self.prefill_chunk < PAGE_SIZE:
            raise ValueError(f"--prefill-chunk must be at least {PAGE_SIZE} tokens, got {self.prefill_chunk}")
        if any(c < 16 * PAGE_SIZE for c in self.contexts):
            raise ValueError(f"--context must be at least {16 * PAGE_SIZE} tokens, got {list(self.contexts)}")
        if self.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {self.tokens}")
        if any(not 0 < b <= 1 for b in self.budgets):
            raise ValueError(f"--budget takes fractions in (0, 1], got {list(self.budgets)}")
        if self.windows < 1:
            raise ValueError(f"--windows must be >= 1, got {self.windows}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if self.text is not None and not self.text.is_file():
            raise ValueError(f"--text {self.text} is not a file")
        if self.text is not None and self.corpus is not None:
            raise ValueError("--text and --corpus: choose one")
        if self.copy is not None and (self.text is not None or self.corpus is not None):
            raise ValueError("--copy with --text or --corpus: choose one")
        if self.copy is not None and (not self.copy or any(k not in COPY_KINDS for k in self.copy)):
            raise ValueError(f"--copy takes text kinds among {', '.join(COPY_KINDS)}, got {list(self.copy)}")
        if self.corpus and not Path(self.corpus).is_dir():
            raise ValueError(f"--corpus {self.corpus} is not a directory")
        try:
            self.attach_config
        except ValueError as exc:
            raise ValueError(str(exc).replace("rank", "--rank", 1).replace("int8_channels", "--int8-channels")
                             .replace("int2_channels", "--int2-channels")) from None

    @property
    def tuned(self) -> bool:
        """Whether window 0 is the text the selectors' settings were chosen on (the licences)."""
        return self.corpus is None and self.copy is None

    @property
    def traced_kind(self) -> IndexKind | None:
        """The selector whose trace the cache part replays: the default index if it runs, else hierarchical."""
        if TRACE_BUDGET not in self.budgets:
            return None
        return next((k for k in (IndexKind.LOWRANK, IndexKind.HIERARCHICAL) if k in self.selectors), None)


@dataclass(frozen=True)
class FidelityRow:
    selector: str
    budget: float
    context: int
    text_window: int
    text_kind: str
    offset: int
    recall: float
    dloss: float
    kl: float
    top1: float
    text_top1: float
    dense_text_top1: float
    index_bytes: int
    kv_bytes: int
    select_ms: float
    cache_bytes: int


@dataclass(frozen=True)
class CacheRow:
    selector: str
    budget: float
    context: int
    window: int
    capacity: int
    policy: str
    hits: int
    lookups: int
    hit_rate: float


# ---------------------------------------------------------------- observers


class RecallObserver(Observer):
    """Exact attention mass of the chosen pages over that of the selectable pages."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.keys: dict[int, torch.Tensor] = {}
        self.valid: dict[int, torch.Tensor] = {}
        self.total = 0.0
        self.count = 0

    @property
    def recall(self) -> float:
        return self.total / self.count if self.count else math.nan

    def on_prefill(self, layer, keys, valid):
        self.keys[layer], self.valid[layer] = keys, valid

    def on_page(self, layer, page, keys, valid):
        self.keys[layer] = torch.cat([self.keys[layer], keys], dim=2)
        self.valid[layer] = torch.cat([self.valid[layer], valid], dim=1)

    def on_select(self, layer, step, query, chosen, selectable, selector):
        s = self.session
        local_k, _, local_start = s.local_window(layer)
        paged = self.keys[layer]
        n = paged.shape[2]
        b, h, g, _ = query.shape
        pages = n // PAGE_SIZE
        assert pages == selectable.shape[1] == s.num_pages(layer), "observer missed a page"
        # The keys past the last complete page (the current token among them) sit only in the local window.
        tail = local_k[:, :, n - local_start :]
        keys = torch.cat([paged, tail], dim=2)
        valid = torch.cat([self.valid[layer], s.valid[:, n : s.seq_length(layer)]], dim=1)
        logits = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * s.shape.scaling
        probs = torch.softmax(logits.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
        mass = probs[..., :n].reshape(b, h, g, pages, PAGE_SIZE).sum(dim=(2, 4))  # [B, H, P]
        on_selectable = (mass * selectable[:, None, :]).sum(dim=-1)
        on_chosen = mass.gather(2, chosen.clamp_min(0)).masked_fill(chosen < 0, 0.0).sum(dim=-1)
        ok = on_selectable > 0
        self.total += float((on_chosen[ok] / on_selectable[ok]).sum())
        self.count += int(ok.sum())


# ---------------------------------------------------------------- runs


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_selectors(model, store, snapshot: PrefillSnapshot, fed: torch.Tensor, kinds: Sequence[IndexKind],
                  budget: float, traced: IndexKind | None = None,
                  attach_cfg: AttachConfig | None = None) -> dict[IndexKind, tuple[torch.Tensor, dict]]:
    """Teacher-forced decode of ``fed`` through one session per selector, side by side (:func:`in_turns`),
    so that the selectors' ``select_ms`` compare. The sessions are independent: each one's
    logits equal those of a run on its own. Returns ``{kind: (logits [T, V], info)}``.
    """
    from kvdrive_client import attach  # noqa: PLC0415

    runs: dict[IndexKind, dict] = {}
    with contextlib.ExitStack() as stack:
        for kind in kinds:
            base = attach_cfg or AttachConfig(page_size=PAGE_SIZE)
            # A fresh handle: fresh stats.
            handle = attach(model, store, budget=budget, index=kind, page_size=base.page_size, rank=base.rank,
                            int8_channels=base.int8_channels, int2_channels=base.int2_channels)
            stack.callback(handle.detach)
            cache = handle.new_cache(1)
            stack.callback(cache.close)
            recall = RecallObserver(cache.session)
            tracer = TraceObserver() if kind is traced else None
            for ob in [recall] + ([tracer] if tracer else []):
                cache.session.add_observer(ob)
            snapshot.replay(cache)
            runs[kind] = {"handle": handle, "cache": cache, "recall": recall, "tracer": tracer, "logits": [],
                          "index_bytes": cache.session.index_bytes()}
        order = list(kinds)

        def take_step(j: int, i: int) -> None:
            run = runs[order[j]]
            run["logits"].append(teacher_force(model, run["cache"], fed[:, i : i + 1]))
            if i == 0:
                run["first"] = run["handle"].stats()  # the first step compiles kernels on a fresh install: not timed

        in_turns(len(order), fed.shape[1], fed.shape[1], take_step)  # select_ms: from each session's own stats
        for run in runs.values():
            run["stats"] = run["handle"].stats()
    out = {}
    for kind, run in runs.items():
        stats, first = run["stats"], run["first"]
        if stats.get("steps", 0) > first.get("steps", 0):
            select_ms = (stats.get("select_ms", 0.0) - first.get("select_ms", 0.0)) / (stats["steps"] - first.get("steps", 0))
        else:
            select_ms = stats.get("select_ms", 0.0) / max(stats.get("steps", 0), 1)
        info = {"recall": run["recall"].recall, "index_bytes": run["index_bytes"], "select_ms": select_ms,
                "cache_bytes": stats.get("device_cache_bytes", 0),
                "trace": run["tracer"].trace() if run["tracer"] else None}
        out[kind] = (torch.cat(run["logits"]), info)
    return out


def cache_rows(trace: Trace, kind: IndexKind, context: int) -> list[CacheRow]:
    k = trace.max_selected
    rows = []
    for window in WINDOWS:
        for policy in POLICIES:
            r = simulate(trace, window * k, policy)
            rows.append(CacheRow(kind.value, TRACE_BUDGET, context, window, r.capacity,
                                 policy.value, r.hits, r.lookups, r.hit_rate))
    return rows


def run_fidelity(cfg: FidelityConfig) -> tuple[list[FidelityRow], list[CacheRow], dict]:
    from kvdrive_client import connect  # noqa: PLC0415
    from kvdrive_client.architecture import GLOBAL, layer_kinds  # noqa: PLC0415
    from kvdrive_client.models import license_text, load_model  # noqa: PLC0415

    t0 = time.perf_counter()
    model, tok = load_model(cfg.model)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    need = max(cfg.contexts) + cfg.tokens + 1
    if need > model.config.max_position_embeddings:
        raise InputError(f"--context {max(cfg.contexts)} + --tokens {cfg.tokens} exceeds the model's "
                         f"{model.config.max_position_embeddings} positions")
    if cfg.copy is not None:
        plan, info = copy_plan(cfg, lambda text: tok(text).input_ids)
    else:
        texts, info = read_texts(cfg, license_text)
        sources = {kind: tok(text, return_tensors="pt").input_ids for kind, text in texts.items()}
        info["text_tokens"] = {k: v.shape[1] for k, v in sources.items()}
        plan = window_plan(sources, need, cfg.windows, strict=cfg.corpus is None, skipped=info["skipped"])
    info.update({"load_s": time.perf_counter() - t0, "max_positions": model.config.max_position_embeddings})
    info["offsets"] = [(kind, offset) for kind, offset in plan]
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    info["itemsize"] = model.dtype.itemsize
    info["head_dim"] = head_dim
    kinds = layer_kinds(c)
    stored = sum(kind == GLOBAL for kind, _ in kinds)
    windows = sorted({w for kind, w in kinds if kind != GLOBAL})
    info["model"] = (f"{cfg.model} ({type(model).__name__}) {str(model.dtype).removeprefix('torch.')}: "
                     f"{c.num_hidden_layers} layers"
                     + (f" ({stored} global through KVDrive, the others sliding-window {'/'.join(map(str, windows))} "
                        f"tokens on the device)" if windows else "")
                     + f", {c.num_attention_heads} query / {c.num_key_value_heads} KV heads, head dim {head_dim}")
    per_token = 2 * stored * c.num_key_value_heads * head_dim * model.dtype.itemsize
    rows: list[FidelityRow] = []
    crows: list[CacheRow] = []
    runs = len(plan) * len(cfg.contexts) * len(cfg.budgets) * len(cfg.selectors)
    done = 0
    store = connect(None, dram=DRAM)
    try:
        with torch.no_grad():
            for w, (kind_name, offset) in enumerate(plan):
                for context in cfg.contexts:
                    if cfg.copy is not None:
                        ids = torch.tensor([info["copies"][(w, context)].ids])
                    else:
                        ids = sources[kind_name]
                    where = f"window {w} ({kind_name}, token {offset}), context {context}"
                    ctx = ids[:, offset : offset + context]
                    fed = ids[:, offset + context : offset + context + cfg.tokens]
                    targets = ids[0, offset + context + 1 : offset + context + cfg.tokens + 1]
                    t = time.perf_counter()
                    snapshot = PrefillSnapshot.capture(model, store, ctx, chunk=cfg.prefill_chunk)
                    _note(f"{where}: dense prefill {time.perf_counter() - t:.0f} s (once, replayed per run)")
                    t = time.perf_counter()
                    dense = teacher_force(model, snapshot.dense_cache(model.config), fed)
                    dense_text = float((dense.argmax(dim=-1) == targets).double().mean())
                    _note(f"{where}: dense decode of {cfg.tokens} tokens {time.perf_counter() - t:.0f} s "
                          f"(its greedy token is the text's on {dense_text:.3f} of them)")
                    for budget in cfg.budgets:
                        t = time.perf_counter()
                        traced = cfg.traced_kind if w == 0 and budget == TRACE_BUDGET else None
                        results = run_selectors(model, store, snapshot, fed, cfg.selectors, budget, traced,
                                                cfg.attach_config)
                        for kind in cfg.selectors:
                            logits, r = results[kind]
                            dloss, kl, top1 = compare(logits, dense, targets)
                            text_top1 = float((logits.argmax(dim=-1) == targets).double().mean())
                            rows.append(FidelityRow(kind.value, budget, context, w, kind_name, offset, r["recall"],
                                                    dloss, kl, top1, text_top1, dense_text, r["index_bytes"],
                                                    per_token * context, r["select_ms"], r["cache_bytes"]))
                            if r["trace"] is not None:
                                crows += cache_rows(r["trace"], kind, context)
                        done += len(cfg.selectors)
                        _note(f"[{done}/{runs}] {where}: {len(cfg.selectors)} selectors side by side at {budget:.3%}: "
                              f"{time.perf_counter() - t:.0f} s; dloss / top1 / recall: "
                              + ", ".join(f"{r.selector} {r.dloss:+.4f} / {r.top1:.3f} / {r.recall:.4f}"
                                          for r in rows[-len(cfg.selectors):]))
                    del snapshot
    finally:
        store.close()
    return rows, crows, info


def copy_plan(cfg: FidelityConfig, tokenize) -> tuple[list[tuple[str, int]], dict]:
    """The windows of a copy run, ``--windows`` per kind (window ``w`` of a kind is seed ``w``), and what
    to say of them; ``info["copies"][(window, context)]`` is that window's text for that context
    (the context ends where the copy is under way, so each context has its own)."""
    plan = [(kind, 0) for kind in cfg.copy for _ in range(cfg.windows)]
    try:
        copies = {(w, c): copytext.build(kind, w % cfg.windows, c, cfg.tokens, tokenize)
                  for w, (kind, _) in enumerate(plan) for c in cfg.contexts}
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return plan, {"source": "generated copy texts (kvdrive.tools.copytext), one per kind, seed and context",
                  "skipped": {}, "copies": copies,
                  "text_tokens": {f"{x.kind}#{x.seed}@{c}": len(x.ids) for (_, c), x in copies.items()}}


def read_texts(cfg: FidelityConfig, license_text) -> tuple[dict[str, str], dict]:
    """The texts windows are drawn from, by kind, and what to say of them."""
    from kvdrive.tools import corpus  # noqa: PLC0415

    if cfg.corpus is None:
        if cfg.text:
            return {"text": cfg.text.read_text(encoding="utf-8")}, {"source": str(cfg.text), "skipped": {}}
        return {"licences": license_text()}, {"source": "/usr/share/common-licenses (concatenated)", "skipped": {}}
    if cfg.corpus:
        return corpus.corpus_from_dir(Path(cfg.corpus)), {"source": f"corpus {cfg.corpus}", "skipped": {}}
    texts, missing = corpus.default_corpus()
    if not texts:
        raise InputError("none of the built-in corpus's texts is on this machine: " + "; ".join(missing.values()))
    described = "; ".join(f"{k.name}: {k.description}" for k in corpus.KINDS if k.name in texts)
    return texts, {"source": f"the built-in corpus ({described})", "skipped": dict(missing)}


def window_plan(sources: dict, need: int, windows: int, strict: bool, skipped: dict) -> list[tuple[str, int]]:
    """(kind, first token) of every window: ``windows`` per text (``strict``: exactly, else as
    many as fit without overlapping; a text too short for one is left out, said in ``skipped``)."""
    plan = []
    for kind, ids in sources.items():
        n = ids.shape[1]
        if strict:
            plan += [(kind, o) for o in window_offsets(n, need, windows)]
            continue
        fit = min(windows, 1 + (n - need) // need) if n >= need else 0
        if fit < 1:
            skipped[kind] = f"{n} tokens, fewer than one window of {need}"
            continue
        if fit < windows:
            skipped[kind] = f"{n} tokens: {fit} of {windows} windows"
        plan += [(kind, o) for o in window_offsets(n, need, fit)]
    return plan


def window_offsets(text_tokens: int, need: int, windows: int) -> list[int]:
    """First tokens of ``windows`` non-overlapping windows of ``need`` tokens: the first at 0, the last at the end."""
    if text_tokens < need:
        raise InputError(f"the text has {text_tokens} tokens; the longest context + --tokens + 1 needs {need}")
    if windows == 1:
        return [0]
    stride = (text_tokens - need) // (windows - 1)
    if stride < need:
        fit = 1 + (text_tokens - need) // need
        raise InputError(f"the text has {text_tokens} tokens: {windows} windows of {need} do not fit without "
                         f"overlapping (at most {fit}: --windows {fit})")
    return [i * stride for i in range(windows)]


# ---------------------------------------------------------------- report


def target_lines(rows: list[FidelityRow], crows: list[CacheRow], itemsize: int = 4, model: str = "smollm2",
                 per_window: bool = True) -> list[str]:
    """Target verdicts; ``itemsize``: bytes per K/V element of the model measured (the models run in float32);
    ``per_window``: the best selector's targets on each window (a corpus run has the worst window's instead)."""
    lines = _index_target_lines([r for r in rows if r.text_window == 0], crows)
    if per_window:
        lines += _best_target_lines(rows, itemsize, MODEL_RUNS[model].target)
    if not lines:
        lines.append("no targets: they need lowrank with oracle / hierarchical, or hierarchical with meankey / quest "
                     "(and a 6.25% budget for the cache)")
    return lines


def _target_context(rows: list[FidelityRow], target: int) -> int:
    contexts = {r.context for r in rows}
    return target if target in contexts else max(contexts)


def _best_target_lines(rows: list[FidelityRow], itemsize: int, m: DenseTarget) -> list[str]:
    """The best selector against dense attention, the oracle and the hierarchical index, per text window."""
    if not rows:
        return []
    by = {(r.selector, r.budget, r.context, r.text_window): r for r in rows}
    context = _target_context(rows, m.context)
    name = IndexKind(TARGET_BEST).value
    lines = []
    for w in sorted({r.text_window for r in rows}):
        held = "tuning window" if w == 0 else "held out"
        first = next(r for r in rows if r.text_window == w)
        at = f"context {context}, window {w} at token {first.offset}, {held}"
        row = by.get((name, TARGET_DLOSS_BUDGET, context, w))
        if row is not None:
            ok = row.dloss <= m.dloss and row.kl <= m.kl
            lines.append(f"target: {name} dloss <= {m.dloss:g} and kl <= {m.kl:g} (budget "
                         f"{TARGET_DLOSS_BUDGET:.3%}, {at}): dloss {row.dloss:+.4f}, kl {row.kl:.4f}: {verdict(ok)}")
            lines.append(_index_bytes_line(name, [row], itemsize, at))
            hier = by.get((IndexKind.HIERARCHICAL.value, TARGET_DLOSS_BUDGET, context, w))
            if hier is not None and hier.select_ms > 0:
                ratio = row.select_ms / hier.select_ms
                lines.append(f"target: {name} select_ms <= {TARGET_SELECT_VS_HIERARCHICAL:g} x hierarchical's (budget "
                             f"{TARGET_DLOSS_BUDGET:.3%}, {at}): {row.select_ms:.2f} / {hier.select_ms:.2f} ms = "
                             f"{ratio:.2f}x: {verdict(ratio <= TARGET_SELECT_VS_HIERARCHICAL)}")
        for budget in sorted({r.budget for r in rows}, reverse=True):
            row, oracle = by.get((name, budget, context, w)), by.get((IndexKind.ORACLE.value, budget, context, w))
            if row is None or oracle is None:
                continue
            goal = TARGET_RECALL_VS_ORACLE * oracle.recall
            lines.append(f"target: {name} recall >= {TARGET_RECALL_VS_ORACLE:g} x oracle's (budget {budget:.3%}, {at}): "
                         f"{row.recall:.4f} vs {TARGET_RECALL_VS_ORACLE:g} x {oracle.recall:.4f} = {goal:.4f} "
                         f"({row.recall / oracle.recall:.3f}x): {verdict(row.recall >= goal)}")
    return lines


def _index_target_lines(rows: list[FidelityRow], crows: list[CacheRow]) -> list[str]:
    by = {(r.selector, r.budget, r.context): r for r in rows}
    lines = []
    for context in sorted({r.context for r in rows}):
        for budget in sorted({r.budget for r in rows}, reverse=True):
            hier = by.get((IndexKind.HIERARCHICAL.value, budget, context))
            mean = by.get((IndexKind.MEAN_KEY.value, budget, context))
            quest = by.get((IndexKind.QUEST.value, budget, context))
            where = f"(budget {budget:.3%}, context {context})"
            if hier and mean:
                goal = TARGET_RECALL_VS_MEANKEY * mean.recall
                lines.append(f"target: hierarchical recall >= {TARGET_RECALL_VS_MEANKEY:g} x meankey recall {where}: "
                             f"{hier.recall:.4f} vs {TARGET_RECALL_VS_MEANKEY:g} x {mean.recall:.4f} = {goal:.4f}: "
                             f"{verdict(hier.recall >= goal)}")
            if hier and quest:
                ratio = hier.index_bytes / quest.index_bytes
                lines.append(f"target: hierarchical index_bytes <= {TARGET_INDEX_VS_QUEST:g} x quest's {where}: "
                             f"{hier.index_bytes} / {quest.index_bytes} = {ratio:.3f}x: "
                             f"{verdict(ratio <= TARGET_INDEX_VS_QUEST)}")
                speedup = quest.select_ms / hier.select_ms if hier.select_ms > 0 else math.inf
                lines.append(f"target: hierarchical select_ms >= {TARGET_SELECT_SPEEDUP:g}x faster than quest's {where}: "
                             f"{quest.select_ms:.2f} ms / {hier.select_ms:.2f} ms = {speedup:.2f}x: "
                             f"{verdict(speedup >= TARGET_SELECT_SPEEDUP)}")
    cby = {(r.context, r.window, r.policy): r for r in crows}
    for context in sorted({r.context for r in crows}):
        look = cby.get((context, TARGET_WINDOW, CachePolicy.LOOKAHEAD.value))
        best = cby.get((context, TARGET_WINDOW, CachePolicy.BELADY.value))
        goal = TARGET_LOOKAHEAD_VS_BELADY * best.hit_rate
        lines.append(f"target: lookahead hit rate >= {TARGET_LOOKAHEAD_VS_BELADY:g} x belady's at x{TARGET_WINDOW} "
                     f"(context {context}): {look.hit_rate:.4f} vs {TARGET_LOOKAHEAD_VS_BELADY:g} x {best.hit_rate:.4f} "
                     f"= {goal:.4f}: {verdict(look.hit_rate >= goal)}")
    return lines


def _sketch_codes(attach_cfg: AttachConfig, head_dim: int) -> str:
    lay = attach_cfg.lowrank_layout(head_dim)
    parts = [f"{n} {kind}" for n, kind in ((lay.int8, "int8"), (lay.int4, "int4"), (lay.int2, "int2")) if n]
    return f"channels {' + '.join(parts)}: {lay.rows} bytes a token"


def render(rows: list[FidelityRow], crows: list[CacheRow], cfg: FidelityConfig, info: dict) -> str:
    attach_cfg = cfg.attach_config
    tuned = cfg.tuned
    windows = ", ".join(f"{w} {k}@{o}" + (" (tuning)" if tuned and w == 0 else " (held out)")
                        for w, (k, o) in enumerate(info["offsets"]))
    tokens = ", ".join(f"{k} {n}" for k, n in info["text_tokens"].items())
    lines = [
        f"kvdrive-bench fidelity: {info['model']}; "
        f"text {info['source']} (tokens: {tokens}); text windows: {windows}",
        f"context {', '.join(map(str, cfg.contexts))} tokens, then {cfg.tokens} teacher-forced decode tokens; page "
        f"{PAGE_SIZE} tokens, sink {attach_cfg.sink_tokens} and local window {attach_cfg.local_tokens} tokens always "
        f"attended; lowrank: rank {attach_cfg.lowrank_layout(info['head_dim']).rank} key sketches ({_sketch_codes(attach_cfg, info['head_dim'])}); "
        f"hierarchical: {attach_cfg.pages_per_cluster} "
        f"pages per cluster, {attach_cfg.candidate_factor:g} x k candidates"
        + (f"; keycodes: every key's {info['head_dim']} channels in 4 bits after a fixed rotation, one fp16 scale a "
           f"key ({info['head_dim'] // 2 + 2} bytes a token)" if IndexKind.KEYCODES in cfg.selectors else ""),
        "select_ms: the session's selection time per decode step from the second step on, all layers (with the "
        "scoring of cached pages for lookahead eviction), the selectors decoding side by side, a step each in turn; "
        f"{os.cpu_count()} CPUs, torch threads: "
        f"{torch.get_num_threads()}; kernels: {cpu_kernels.VECTOR_WIDTH}; model load {info['load_s']:.0f} s",
        "vs oracle: recall over the oracle's at the same window, context and budget; index/kv: index_bytes over "
        "the full K+V of every global layer at the context (float32, as the model runs); cache/kv: the device "
        "cache's bytes at the end of the decode over the same",
    ]
    for kind, why in info.get("skipped", {}).items():
        lines.append(f"NOTE: corpus text {kind}: {why}")
    if cfg.copy is not None:
        lines += copy_lines(rows, info["copies"])
    if max(cfg.contexts) > cfg.prefill_chunk:
        lines.append(f"contexts over {cfg.prefill_chunk} tokens are prefilled densely in chunks of {cfg.prefill_chunk}")
    target = MODEL_RUNS[cfg.model].target.context
    if target not in cfg.contexts or cfg.tokens != DEFAULT_TOKENS:
        lines.append(f"NOTE: not the benchmark's {target}-token context with {DEFAULT_TOKENS} decode tokens "
                     "(--quick / --context / --tokens)")
    lines.append("")
    oracle = {(r.budget, r.context, r.text_window): r.recall for r in rows if r.selector == IndexKind.ORACLE.value}
    body = []
    for r in rows:
        o = oracle.get((r.budget, r.context, r.text_window))
        body.append((f"{r.text_window} {r.text_kind}", r.selector, f"{r.budget:.3%}", str(r.context), f"{r.recall:.4f}",
                     f"{r.recall / o:.3f}" if o else "-", f"{r.dloss:+.4f}", f"{r.kl:.4f}", f"{r.top1:.3f}",
                     str(r.index_bytes), f"{r.index_bytes / r.kv_bytes:.4f}", f"{r.cache_bytes / r.kv_bytes:.4f}",
                     f"{r.select_ms:.2f}"))
    lines += text_table(("window", "selector", "budget", "context", "recall", "vs oracle", "dloss", "kl", "top1",
                         "index_bytes", "index/kv", "cache/kv", "select_ms"), body, set(range(2, 13)))
    if crows:
        k = {r.context: r.capacity // r.window for r in crows}
        lines += ["", f"cache (text window 0): {crows[0].selector} selection trace at {TRACE_BUDGET:.2%}, replayed per "
                  f"(layer, KV head); capacity = window x k, k = {', '.join(f'{v} pages at {c}' for c, v in k.items())}; "
                  "seeded from the prefill at start"]
        body = [(str(r.context), f"x{r.window}", str(r.capacity), r.policy, str(r.hits), str(r.lookups),
                 f"{r.hit_rate:.4f}") for r in crows]
        lines += text_table(("context", "window", "capacity", "policy", "hits", "lookups", "hit_rate"), body, {2, 4, 5, 6})
    elif cfg.traced_kind is None:
        lines += ["", "cache: skipped (needs the lowrank or hierarchical selector at a 6.25% budget)"]
    if len(info["offsets"]) > 1:
        lines += ["", *worst_window_lines(rows)]
    lines += ["", *target_lines(rows, crows, info["itemsize"], cfg.model, per_window=tuned)]
    if not tuned:
        lines += worst_target_lines(rows, info["itemsize"])
    if cfg.copy is not None:
        lines += copy_target_lines(rows)
    return "\n".join(lines)


@dataclass(frozen=True)
class WindowSummary:
    """One selector at one budget and context over every window: the mean and the worst."""

    selector: str
    budget: float
    context: int
    windows: int
    mean_dloss: float
    worst: FidelityRow
    oracle_on_worst: FidelityRow | None
    worst_kl: float
    min_recall_vs_oracle: float
    least_top1: FidelityRow  # the window whose greedy tokens agree least with dense's


def summarize_windows(rows: list[FidelityRow]) -> list[WindowSummary]:
    """Per (selector, budget, context): mean Δloss over the windows, the window of the largest
    Δloss (with the oracle's row on that window), the largest KL, the lowest recall over the oracle's."""
    oracle = {(r.budget, r.context, r.text_window): r for r in rows if r.selector == IndexKind.ORACLE.value}
    groups: dict[tuple, list[FidelityRow]] = {}
    for r in rows:
        groups.setdefault((r.selector, r.budget, r.context), []).append(r)
    out = []
    for (sel, budget, context), rs in groups.items():
        worst = max(rs, key=lambda r: r.dloss)
        ratios = [r.recall / o.recall for r in rs if (o := oracle.get((budget, context, r.text_window))) and o.recall > 0]
        out.append(WindowSummary(sel, budget, context, len(rs), sum(r.dloss for r in rs) / len(rs), worst,
                                 oracle.get((budget, context, worst.text_window)), max(r.kl for r in rs),
                                 min(ratios) if ratios else math.nan, min(rs, key=lambda r: r.top1)))
    return out


def worst_window_lines(rows: list[FidelityRow]) -> list[str]:
    body = []
    for w in summarize_windows(rows):
        o = w.oracle_on_worst
        body.append((w.selector, f"{w.budget:.3%}", str(w.context), str(w.windows), f"{w.mean_dloss:+.4f}",
                     f"{w.worst.dloss:+.4f}", f"{w.worst.text_window} {w.worst.text_kind}",
                     f"{o.dloss:+.4f}" if o else "-", f"{w.worst.kl:.4f}", f"{w.worst_kl:.4f}",
                     f"{w.min_recall_vs_oracle:.3f}", f"{w.least_top1.top1:.3f}"))
    return ["worst window: per selector, budget and context, over every window; oracle: its dloss on that window; "
            "min top1: the lowest share of steps whose greedy token is dense's",
            *text_table(("selector", "budget", "context", "windows", "mean dloss", "worst dloss", "at window",
                         "oracle", "kl there", "worst kl", "min vs oracle", "min top1"), body,
                        {1, 2, 3, 4, 5, 7, 8, 9, 10, 11})]


def copy_lines(rows: list[FidelityRow], copies: dict) -> list[str]:
    """What each copy text holds, and how well dense attention itself copies there."""
    dense = {(r.text_window, r.context): r.dense_text_top1 for r in rows}
    out = []
    for (w, context), c in sorted(copies.items()):
        d = dense.get((w, context))
        out.append(f"copy text: window {w} {c.kind} seed {c.seed}, context {context}: {len(c.ids)} tokens, the copy "
                   f"from token {c.copy_start} (its source: {c.source_tokens} tokens from the start); dense's greedy "
                   f"token is the text's on " + (f"{d:.3f}" if d is not None else "-") + " of the decoded tokens")
    return out


def copy_target_lines(rows: list[FidelityRow]) -> list[str]:
    """The default selector's greedy tokens against dense's on every copy window, per budget and context."""
    lines = []
    for (budget, context), goal in sorted(((b, c), TARGET_COPY_MATCH.get(b)) for b, c in
                                           {(r.budget, r.context) for r in rows if r.selector == TARGET_BEST}):
        if goal is None:
            continue
        best = [r for r in rows if r.selector == TARGET_BEST and r.budget == budget and r.context == context]
        low = min(best, key=lambda r: r.top1)
        mean = sum(r.top1 for r in best) / len(best)
        lines.append(f"target: {TARGET_BEST} greedy token = dense's on >= {goal:g} of the copied tokens on every "
                     f"window (budget {budget:.3%}, context {context}, {len(best)} windows): lowest {low.top1:.3f} at "
                     f"window {low.text_window} ({low.text_kind}), mean {mean:.3f}: {verdict(low.top1 >= goal)}")
    return lines


def _index_bytes_line(name: str, rows: list[FidelityRow], itemsize: int, at: str) -> str:
    """The largest index over the fp16 K+V of these rows (the K+V measured is ``itemsize`` bytes an element)."""
    row = max(rows, key=lambda r: r.index_bytes / r.kv_bytes)
    ratio = row.index_bytes / row.kv_bytes
    fp16 = ratio * itemsize / 2
    return (f"target: {name} index_bytes <= {TARGET_INDEX_VS_FP16_KV:g} x an fp16 K+V ({at}): {row.index_bytes} / "
            f"{row.kv_bytes} = {ratio:.4f}x of the K+V as run, {fp16:.4f}x of an fp16 K+V: "
            f"{verdict(fp16 <= TARGET_INDEX_VS_FP16_KV)}")


def worst_target_lines(rows: list[FidelityRow], itemsize: int = 4) -> list[str]:
    """The default selector's worst window against its bounds, at each budget (corpus runs), and
    over every window its largest index and its selection time against the hierarchical index's."""
    lines = []
    for context in sorted({r.context for r in rows}):
        best = [r for r in rows if r.selector == TARGET_BEST and r.context == context and r.budget == TARGET_DLOSS_BUDGET]
        if not best:
            continue
        at = f"budget {TARGET_DLOSS_BUDGET:.3%}, context {context}, {len(best)} windows"
        lines.append(_index_bytes_line(TARGET_BEST, best, itemsize, at))
        hier = {r.text_window: r for r in rows if r.selector == IndexKind.HIERARCHICAL.value and r.context == context
                and r.budget == TARGET_DLOSS_BUDGET and r.select_ms > 0}
        ratios = sorted(r.select_ms / hier[r.text_window].select_ms for r in best if r.text_window in hier)
        if ratios:
            # The median over the windows: one window slowed by the rest of a shared machine (both
            # selectors decode side by side, but a burst can fall on one's turns) moves it least.
            median = statistics.median(ratios)
            lines.append(f"target: {TARGET_BEST} select_ms <= {TARGET_SELECT_VS_HIERARCHICAL:g} x hierarchical's ({at}, "
                         f"side by side on each window): median {median:.2f}x (windows {ratios[0]:.2f}x to "
                         f"{ratios[-1]:.2f}x): {verdict(median <= TARGET_SELECT_VS_HIERARCHICAL)}")
    for w in summarize_windows(rows):
        if w.selector != TARGET_BEST:
            continue
        at = f"budget {w.budget:.3%}, context {w.context}, {w.windows} windows"
        o = w.oracle_on_worst
        worst, over = TARGET_WORST.get(w.budget, TARGET_WORST_OTHER)
        vs = "" if o is None else f" and <= oracle's {o.dloss:+.4f} + {over:g}"
        ok = w.worst.dloss <= worst and (o is None or w.worst.dloss <= o.dloss + over)
        lines.append(f"target: {TARGET_BEST} worst-window dloss <= {worst:g}{vs} ({at}): "
                     f"{w.worst.dloss:+.4f} at window {w.worst.text_window} ({w.worst.text_kind}): {verdict(ok)}")
        lines.append(f"target: {TARGET_BEST} mean dloss <= {TARGET_MEAN_DLOSS:g} ({at}): {w.mean_dloss:+.4f}: "
                     f"{verdict(w.mean_dloss <= TARGET_MEAN_DLOSS)}")
        if not math.isnan(w.min_recall_vs_oracle):
            lines.append(f"target: {TARGET_BEST} recall >= {TARGET_RECALL_VS_ORACLE:g} x oracle's on every window "
                         f"({at}): lowest {w.min_recall_vs_oracle:.3f}x: "
                         f"{verdict(w.min_recall_vs_oracle >= TARGET_RECALL_VS_ORACLE)}")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        m = MODEL_RUNS.get(args.model, MODEL_RUNS["smollm2"])
        cfg = FidelityConfig(
            contexts=tuple(args.context or (m.quick_contexts if args.quick else m.contexts)),
            tokens=args.tokens if args.tokens is not None else (QUICK_TOKENS if args.quick else DEFAULT_TOKENS),
            budgets=tuple(args.budget or (QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)),
            selectors=tuple(IndexKind(s) for s in args.selectors),
            text=args.text,
            threads=args.threads,
            windows=args.windows if args.windows is not None else (QUICK_WINDOWS if args.quick else DEFAULT_WINDOWS),
            corpus=args.corpus,
            copy=None if args.copy is None else tuple(args.copy or COPY_KINDS),
            model=args.model,
            prefill_chunk=args.prefill_chunk,
            rank=args.rank,
            int8_channels=args.int8_channels,
            int2_channels=args.int2_channels,
        )
    except ValueError as exc:
        print(f"kvdrive-bench fidelity: {exc}", file=sys.stderr)
        return 2
    try:
        rows, crows, info = run_fidelity(cfg)
    except InputError as exc:
        print(f"kvdrive-bench fidelity: {exc}", file=sys.stderr)
        return 2
    print(render(rows, crows, cfg, info), flush=True)
    if args.json is not None:
        doc = {"fidelity": [asdict(r) for r in rows], "cache": [asdict(r) for r in crows]}
        if len(info["offsets"]) > 1:
            doc["windows"] = [{**asdict(w), "worst": asdict(w.worst),
                               "oracle_on_worst": asdict(w.oracle_on_worst) if w.oracle_on_worst else None}
                              for w in summarize_windows(rows)]
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
