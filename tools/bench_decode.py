"""``kvdrive-bench decode``: end-to-end decode throughput, KVDrive against the baselines.

Every configuration runs in one process, one after another, on the same inputs:

- ``dense``: all KV resident next to the compute (transformers' own cache for a
  real model; plain tensors for the attention-only workload), exact attention.
- ``whole-layer``: every page of a layer fetched from the store every step
  (FlexGen-style offloading; no selection).
- ``quest``: Quest-style min/max page index, no cache (x0): every selected page
  is fetched every step.
- ``shadowkv``: ShadowKV-style mean-key landmarks, a cache of one step's selection
  (x1: pages the previous step selected are reused).
- ``kvdrive``: attach()'s default index (lowrank: key sketches of 27/64 of the head dim in
  int8, int4 and int2 codes, 11 bytes a token at head dim 64, pages ranked by estimated
  attention mass) and a x4 lookahead cache per (layer, KV head);
  ``kvdrive-profile``: the same with per-head windows from a window profile at
  equal total cache bytes. Each with the pipeline on and off (``+pipe`` / ``-pipe``).
  ``kvdrive-hierarchical+pipe`` (full runs only): ``kvdrive+pipe`` with the cheaper
  hierarchical index (int8 page means under k-means centroids), for the cost of the
  default index. In (a) these two also decode side by side, a step each in turn, on
  a store of twice the tier: the index target compares those tokens/s, which share
  the machine's slow spells (the one-after-the-other rows drift 10-20%).

Store-backed rows run on a DRAM tier that holds everything (``dram``) and on one
well below the KV size (``dram+ssd``). In (b) a configuration's two tiers run back to
back, each on a fresh daemon. Then ``shadowkv`` and ``kvdrive+pipe`` also decode (b)
side by side on the DRAM tier, a step each in turn: target 1 takes its tokens/s ratio
from that run.

Workloads: (a) SmolLM2-135M on real text, teacher-forced so every configuration
decodes the same tokens and its loss / KL against dense can be printed; (b) an
attention-only workload with Llama-3-8B's layer shape and synthetic keys and
queries whose selection locality is calibrated to (a)'s; (c) (b) at a KV size about
3x the DRAM tier. Measured tokens/s exclude warm-up steps (which also calibrate the
micro-batch size).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kvdrive.kernels import cpu as cpu_kernels
from kvdrive.tools.bench_common import InputError, PrefillSnapshot, TraceObserver, compare, in_turns
from kvdrive.tools.decode_workload import selection_overlap
from kvdrive.tools.targets import (TARGET_A_BATCH, TARGET_A_VS_SHADOWKV, TARGET_BYTES_VS_X0, TARGET_C_VS_B,
                                   TARGET_INDEX_SPEED, TARGET_OVERLAP_GAP, TARGET_SKETCH_SPEED, TARGET_PIPELINE_VS_LONGEST,
                                   TARGET_PROFILE_VS_UNIFORM, TARGET_SPEEDUP_VS_SHADOWKV, TARGET_SSD_VS_DRAM, verdict)
from kvdrive.tools.text_table import text_table
from kvdrive_client.config import AttachConfig
from kvdrive_client.selectors import IndexKind
from kvdrive_client.session import Observer

log = logging.getLogger(__name__)

PAGE_SIZE = 16
BUDGET = 0.0625
WARMUP_STEPS = 7  # one warm-up step, then the micro-batch candidates (4, 2, 1 rows) twice round
QUICK_WARMUP_STEPS = 2  # --quick fixes the micro-batch at half the batch instead of calibrating it
PROFILE_SEQUENCES = 2  # calibration sequences of a window profile, each held out in turn
# (b) dram: target 1's ratio, measured side by side: the baseline, then KVDrive (a third
# session of 4 GiB, kvdrive-pipe, took this 23 GiB host to 3 GiB free)
SIDE_BY_SIDE_B = ("shadowkv", "kvdrive+pipe")


@dataclass(frozen=True)
class Config:
    """One configuration: how the KV is held and selected."""

    name: str
    store: bool = True
    options: dict = field(default_factory=dict)
    profile: bool = False
    a_only: bool = False  # SmolLM2's shape only (workload a)


def configurations(pipeline_variants: bool = True) -> list[Config]:
    kv = dict(cache_multiplier=4.0, eviction="lookahead")  # the index is attach()'s default
    rows = [
        Config("dense", store=False),
        Config("whole-layer", options=dict(budget=1.0, index=IndexKind.MEAN_KEY, cache_multiplier=0, pipeline=False)),
        Config("quest", options=dict(index=IndexKind.QUEST, cache_multiplier=0, pipeline=False)),
        Config("shadowkv", options=dict(index=IndexKind.MEAN_KEY, cache_multiplier=1.0, eviction="lru", pipeline=False)),
    ]
    for name, profile in (("kvdrive", False), ("kvdrive-profile", True)):
        rows.append(Config(f"{name}+pipe", options=dict(kv, pipeline=True), profile=profile))
        if pipeline_variants or not profile:  # kvdrive-pipe also measures the selection overlap
            rows.append(Config(f"{name}-pipe", options=dict(kv, pipeline=False), profile=profile))
    if pipeline_variants:  # the default index against the cheaper clustered one, side by side
        rows.append(Config("kvdrive-hierarchical+pipe", options=dict(kv, index=IndexKind.HIERARCHICAL, pipeline=True)))
        # ... and the default sketch against the earlier, smaller one (a quarter of the head
        # dim, 8 channels int8: 12 bytes a token at head dim 64 against 11, but 16 channels, not 22)
        rows.append(Config("kvdrive-rank16+pipe", options=dict(kv, rank=16, int8_channels=8, pipeline=True), a_only=True))
    return rows


# (a): pairs of configurations that also decode side by side, by the info key of their result
SIDE_BY_SIDE_A = {"a_index_side_by_side": ("kvdrive+pipe", "kvdrive-hierarchical+pipe"),
                  "a_sketch_side_by_side": ("kvdrive+pipe", "kvdrive-rank16+pipe")}


BASELINES = ("dense", "whole-layer", "quest", "shadowkv")


@dataclass
class Row:
    """One workload x configuration x tier; the fields up to ``step_ms`` are the JSON keys the bench promises."""

    workload: str
    config: str
    tier: str
    batch: int
    tokens_per_s: float
    bytes_per_step_dram: float
    bytes_per_step_ssd: float
    hit_rate: float | None
    select_ms: float
    fetch_ms: float
    compute_ms: float
    step_ms: float
    hitmiss_ms: float = 0.0
    attn_ms: float = 0.0
    fetch_wait_ms: float = 0.0
    cache_bytes: int = 0
    dloss: float | None = None
    kl: float | None = None
    top1: float | None = None
    overlap: float | None = None


@dataclass(frozen=True)
class BenchConfig:
    quick: bool = False
    workloads: tuple[str, ...] = ("a", "b", "c")
    context_a: int = 7168
    steps_a: int = 24
    batches_a: tuple[int, ...] = (1, 4)
    layers_b: int = 8
    context_b: int = 32768
    batch_b: int = 4
    steps_b: int = 12
    seed: int = 0
    text: Path | None = None
    warmup: int = WARMUP_STEPS
    device: str = "cpu"  # workloads b and c: where the KV, the queries and the attention live

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BenchConfig":
        c = cls()
        if args.quick:
            c = replace(c, quick=True, context_a=1024, steps_a=8, layers_b=2, context_b=4096, steps_b=4,
                        warmup=QUICK_WARMUP_STEPS)
        if args.batches_a:
            c = replace(c, batches_a=tuple(args.batches_a))
        for name in ("context_a", "steps_a", "layers_b", "context_b", "steps_b", "seed"):
            value = getattr(args, name, None)
            if value is not None:
                c = replace(c, **{name: value})
        if args.workloads:
            c = replace(c, workloads=tuple(args.workloads))
        if args.text is not None:
            c = replace(c, text=args.text)
        if getattr(args, "device", None):
            c = replace(c, device=args.device)
        if c.device != "cpu" and "a" in c.workloads:
            raise InputError(f"--device {c.device} runs the attention-only workloads b and c (workload a decodes "
                             f"SmolLM2 on the CPU): add --workloads b,c")
        for name in ("context_a", "context_b"):
            if getattr(c, name) < 512 or getattr(c, name) % PAGE_SIZE:
                raise InputError(f"--{name.replace('_', '-')} must be a multiple of {PAGE_SIZE} and >= 512")
        if c.steps_a <= c.warmup or c.steps_b < 1 or c.layers_b < 1:
            raise InputError(f"--steps-a must exceed the {c.warmup} warm-up steps, --steps-b and --layers-b must be >= 1")
        if any(b < 1 for b in c.batches_a):
            raise InputError("--batches-a takes batch sizes >= 1")
        if set(c.workloads) - {"a", "b", "c"}:
            raise InputError(f"--workloads takes a, b and c, got {','.join(c.workloads)}")
        if c.text is not None and not c.text.is_file():
            raise InputError(f"--text {c.text}: no such file")
        return c


_T0 = time.perf_counter()


def _note(text: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- measurement helpers


class OverlapObserver(Observer):
    """Previous-step overlap of the pages each (row, layer, KV head) selects.

    It only keeps a copy of each selection while the decode is timed; the overlaps are
    computed when asked for, so the row that carries it is not slowed by the measurement.
    """

    def __init__(self) -> None:
        self.chosen: dict[int, list[torch.Tensor]] = {}

    def on_select(self, layer, step, query, chosen, selectable, selector):
        self.chosen.setdefault(layer, []).append(chosen.clone())

    @property
    def overlap(self) -> float | None:
        values = [selection_overlap(prev, now) for seq in self.chosen.values() for prev, now in zip(seq, seq[1:])
                  if prev.shape == now.shape]
        return float(np.mean(values)) if values else None


def _note_calibration(where: str, session) -> None:
    """Say what the session's warm-up calibration chose (the micro-batch a "+pipe" row really ran)."""
    if session.calibration:
        _note(f"{where}: calibrated {session.calibration}")


def _release_freed_memory() -> None:
    """Hand the heap this process has freed back to the OS (glibc keeps it otherwise).

    After (a) the process held about 4 GiB of freed heap; the daemon of (b)'s side-by-side
    run, a separate process, needs that memory for its DRAM tier.
    """
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        log.info("no glibc here: freed heap is left to the allocator")
        return
    libc.malloc_trim(0)


def _delta(after: Counter, before: Counter) -> Counter:
    return Counter({k: after.get(k, 0) - before.get(k, 0) for k in after})


def _row(workload: str, cfg: Config, tier: str, batch: int, steps: int, seconds: float, stats: Counter,
         block_bytes: int, cache_bytes: int = 0) -> Row:
    looked = stats.get("hits", 0) + stats.get("misses", 0)
    per = max(steps, 1)
    return Row(
        workload, cfg.name, tier if cfg.store else "-", batch, batch * steps / seconds,
        stats.get("blocks_dram", 0) * block_bytes / per, stats.get("blocks_ssd", 0) * block_bytes / per,
        stats.get("hits", 0) / looked if looked else None,
        stats.get("select_ms", 0.0) / per, stats.get("fetch_ms", 0.0) / per,
        stats.get("attention_ms", 0.0) / per if cfg.store else seconds * 1e3 / per, seconds * 1e3 / per,
        hitmiss_ms=stats.get("hitmiss_ms", 0.0) / per, fetch_wait_ms=stats.get("fetch_wait_ms", 0.0) / per,
        attn_ms=stats.get("layer_ms", 0.0) / per if cfg.store else seconds * 1e3 / per,
        cache_bytes=cache_bytes,
    )


def _options(c: Config, cfg: BenchConfig, batch: int) -> dict:
    options = dict(c.options, budget=c.options.get("budget", BUDGET), page_size=PAGE_SIZE)
    if cfg.quick and options.get("pipeline", True):
        options.setdefault("micro_batch", max(1, batch // 2))
    return options


# ---------------------------------------------------------------- workload (a): SmolLM2 on real text


def _windows(ids: torch.Tensor, batch: int, context: int, steps: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` disjoint windows of ``context + steps`` tokens: (prompts, the tokens fed after them)."""
    need = context + steps
    if offset + batch * need > ids.shape[0]:
        raise InputError(f"the text has {ids.shape[0]} tokens; {batch} windows of {need} from {offset} need more")
    rows = torch.stack([ids[offset + i * need : offset + (i + 1) * need] for i in range(batch)])
    return rows[:, :context], rows[:, context:]


def _decode_model(model, cache, fed: torch.Tensor, warmup: int) -> tuple[torch.Tensor, float, Counter | None, Counter | None]:
    """Teacher-forced decode: logits ``[B, T, V]``, seconds over the measured steps, stats at start/end."""
    session = getattr(cache, "session", None)
    logits, before, start = [], None, None
    with torch.no_grad():
        for i in range(fed.shape[1]):
            if i == min(warmup, fed.shape[1] - 1):
                start = time.perf_counter()
                before = Counter(session.stats) if session is not None else None
            logits.append(model(input_ids=fed[:, i : i + 1], cache=cache).logits[:, -1].float())
    seconds = time.perf_counter() - start
    after = Counter(session.stats) if session is not None else None
    return torch.stack(logits, dim=1), seconds, before, after


def _index_side_by_side(model, snapshot, fed: torch.Tensor, batch: int, tier: str, dram: int, ssd_max: int,
                        pair: list[Config], cfg: BenchConfig) -> dict:
    """Two configurations (``pair``: the default, then another index or sketch) decoding side by
    side on a store of twice the tier."""
    from kvdrive_client import attach, connect  # noqa: PLC0415

    with connect(None, dram=f"{2 * dram // 1024}K", ssd_max=f"{2 * ssd_max // (1 << 20)}M") as store, \
            contextlib.ExitStack() as stack:
        caches = []
        for c in pair:
            handle = attach(model, store, **_options(c, cfg, batch))
            stack.callback(handle.detach)
            cache = handle.new_cache(batch)
            stack.callback(cache.close)
            snapshot.replay(cache)
            caches.append(cache)
        first = min(cfg.warmup, fed.shape[1] - 1)
        seconds = in_turns(len(caches), fed.shape[1], first,
                            lambda j, i: model(input_ids=fed[:, i : i + 1], cache=caches[j]))
    steps = fed.shape[1] - first
    return {"batch": batch, "tier": tier, "tokens_per_s": {c.name: batch * steps / t for c, t in zip(pair, seconds)}}


def _profile_from_session(tracer, session, name: str, context: int):
    from kvdrive_client.profile import profile_from_trace  # noqa: PLC0415

    sh = session.shape
    return profile_from_trace(tracer.trace(), num_layers=sh.num_layers, num_kv_heads=sh.num_kv_heads,
                              page_bytes=session.block_bytes, sink_pages=session.cfg.sink_pages, model=name,
                              dtype=str(sh.dtype).removeprefix("torch."), page_size=PAGE_SIZE, budget=BUDGET,
                              text="calibration", context=context)


def _profile_windows(model, store, ids: torch.Tensor, context: int, steps: int) -> tuple[tuple, dict]:
    """A window profile from calibration text: the text's last windows, held out from the measured ones.

    Two calibration sequences, so that the profile checks its per-head windows by
    fitting on one and scoring on the other.
    """
    from kvdrive_client import attach  # noqa: PLC0415

    n = PROFILE_SEQUENCES
    prompt, fed = _windows(ids, n, context, steps, offset=ids.shape[0] - n * (context + steps))
    snapshot = PrefillSnapshot.capture(model, store, prompt)
    handle = attach(model, store, budget=BUDGET, page_size=PAGE_SIZE, pipeline=False)
    try:
        cache = handle.new_cache(n)
        tracer = TraceObserver()
        cache.session.add_observer(tracer)
        snapshot.replay(cache)
        with torch.no_grad():
            for i in range(fed.shape[1]):
                model(input_ids=fed[:, i : i + 1], cache=cache)
        prof = _profile_from_session(tracer, cache.session, "SmolLM2-135M", context)
        cache.close()
    finally:
        handle.detach()
    return tuple(tuple(w) for w in prof.windows), {"a_profile_bytes": prof.used_bytes,
                                                    "a_profile_predicted": prof.fetched_bytes_per_step(),
                                                    "a_uniform_predicted": prof.uniform()[2],
                                                    "a_profile_shrink": prof.shrink}


def run_workload_a(cfg: BenchConfig, configs: list[Config], rows: list[Row], info: dict) -> None:
    from kvdrive_client import attach, connect  # noqa: PLC0415
    from kvdrive_client.models import license_text, load_smollm2  # noqa: PLC0415

    model, tok = load_smollm2()
    text = cfg.text.read_text(encoding="utf-8") if cfg.text else license_text()
    ids = tok(text, return_tensors="pt").input_ids[0]
    info["a_text_tokens"] = int(ids.shape[0])
    kv_row = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * 4 * (cfg.context_a + cfg.steps_a)
    windows = None
    for batch in cfg.batches_a:
        prompt, fed = _windows(ids, batch, cfg.context_a, cfg.steps_a)
        kv_bytes = kv_row * batch
        tiers = {"dram": max(2 * kv_bytes, 64 << 20), "dram+ssd": max(kv_bytes // 4, 4 << 20)}
        dense_logits = snapshot = None
        for tier, dram in tiers.items():
            ssd_max = max(8 * kv_bytes, 1 << 30)
            with connect(None, dram=f"{dram // 1024}K", ssd_max=f"{ssd_max // (1 << 20)}M") as store:
                if windows is None and any(c.profile for c in configs):
                    _note("workload a: profiling windows on held-out calibration text")
                    windows, pinfo = _profile_windows(model, store, ids, cfg.context_a, max(2 * cfg.steps_a, 32))
                    info.update(pinfo)
                if snapshot is None:  # the model's prefill, once per batch; every configuration replays it
                    _note(f"workload a: batch {batch}: prefill snapshot of {cfg.context_a} tokens")
                    snapshot = PrefillSnapshot.capture(model, store, prompt)
                for c in configs:
                    if not c.store and tier != "dram":
                        continue
                    _note(f"workload a: batch {batch}, {tier}: {c.name}")
                    if not c.store:
                        cache = snapshot.dense_cache(model.config)
                        logits, seconds, _, _ = _decode_model(model, cache, fed, cfg.warmup)
                        dense_logits = logits
                        rows.append(_row("a", c, tier, batch, fed.shape[1] - cfg.warmup, seconds, Counter(), 0))
                        continue
                    options = _options(c, cfg, batch)
                    if c.profile:
                        options["head_multipliers"] = windows
                    handle = attach(model, store, **options)
                    try:
                        cache = handle.new_cache(batch)
                        observer = OverlapObserver() if c.name == "kvdrive-pipe" else None
                        if observer:
                            cache.session.add_observer(observer)
                        snapshot.replay(cache)
                        logits, seconds, before, after = _decode_model(model, cache, fed, cfg.warmup)
                        _note_calibration(f"workload a: batch {batch}, {tier}: {c.name}", cache.session)
                        bb = cache.session.block_bytes
                        used = _cache_bytes_in_use(cache.session)
                        cache.close()
                    finally:
                        handle.detach()
                    row = _row("a", c, tier, batch, fed.shape[1] - cfg.warmup, seconds, _delta(after, before), bb, used)
                    if dense_logits is not None:
                        dl, kl, top1 = compare(logits.reshape(-1, logits.shape[-1]), dense_logits.reshape(-1, logits.shape[-1]),
                                               _targets(fed))
                        row.dloss, row.kl, row.top1 = dl, kl, top1
                    if observer:
                        row.overlap = observer.overlap
                    rows.append(row)
                for key, names in SIDE_BY_SIDE_A.items():
                    pair = [c for name in names for c in configs if c.name == name]
                    if len(pair) == 2:
                        _note(f"workload a: batch {batch}, {tier}: {pair[0].name} and {pair[1].name} side by side")
                        info.setdefault(key, []).append(
                            _index_side_by_side(model, snapshot, fed, batch, tier, dram, ssd_max, pair, cfg))


def _targets(fed: torch.Tensor) -> torch.Tensor:
    """The next text token after each fed one; the last step has none, so it predicts itself (same for all rows)."""
    nxt = torch.cat([fed[:, 1:], fed[:, -1:]], dim=1)
    return nxt.reshape(-1)


def _cache_bytes_in_use(session) -> int:
    """Bytes of cache slots each (row, head) may use: per-head windows count their own limit."""
    total = 0
    for layer in range(session.shape.num_layers):
        c = session.cache(layer)
        if c is None:
            continue
        per_slot = 2 * c.k[0, 0, 0].numel() * c.k.element_size()
        slots = int(c.head_capacity.sum()) * c.k.shape[0] if c.head_capacity is not None else c.capacity * c.k.shape[0] * c.k.shape[1]
        total += slots * per_slot
    return total


# ---------------------------------------------------------------- workloads (b) and (c): attention only


class DenseAttention:
    """All KV of every layer resident in preallocated tensors; exact attention each step."""

    def __init__(self, layers: int, batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype, scaling: float,
                 device: torch.device | str = "cpu"):
        self.k = [torch.empty(batch, heads, tokens, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty_like(self.k[0]) for _ in range(layers)]
        self.n = [0] * layers
        self.scaling = scaling

    def prefill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        t = keys.shape[2]
        self.k[layer][:, :, :t] = keys
        self.v[layer][:, :, :t] = values
        self.n[layer] = t

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from kvdrive.kernels import for_device  # noqa: PLC0415

        n = self.n[layer]
        self.k[layer][:, :, n] = k
        self.v[layer][:, :, n] = v
        self.n[layer] = n + 1
        b, h, _, d = self.k[layer].shape
        keys, values = self.k[layer][:, :, : n + 1], self.v[layer][:, :, : n + 1]
        valid = torch.ones(b, h, n + 1, dtype=torch.bool, device=keys.device)
        # The kernels' attention dtype: float32 for half K/V on the CPU, as KVDrive's own attention.
        out = for_device(keys.device).dense_attention(q.reshape(b, h, -1, d), keys, values, valid, self.scaling)
        return out.to(values.dtype).reshape(b, -1, d)


def _run_attention(workload, c: Config, store, steps: int, windows, cfg: BenchConfig,
                   where: str, device: torch.device | str = "cpu") -> tuple[float, Counter, int, int, float | None]:
    """Prefill and decode one configuration; (seconds over measured steps, stats delta, block bytes, cache bytes, overlap).

    ``device``: where the KV, the queries and the attention live (the workload makes CPU
    tensors; they are moved there untimed). On a CUDA device each layer's decode is timed
    to its end (the device synchronised)."""
    from kvdrive_client.engine import SparseKV  # noqa: PLC0415

    w = workload
    device = torch.device(device)
    sync = device.type == "cuda"
    total_steps = cfg.warmup + steps
    if not c.store:
        kv = DenseAttention(w.num_layers, w.batch, w.num_kv_heads, w.context_tokens + total_steps, w.head_dim, w.dtype,
                            w.scaling, device=device)
        for layer in range(w.num_layers):
            _, keys, values = w.prefill_kv(layer)
            kv.prefill(layer, keys.to(device), values.to(device))
            del keys, values
    else:
        options = _options(c, cfg, w.batch)
        if c.profile:
            options["head_multipliers"] = windows
        kv = SparseKV(store, w.shape, batch=w.batch, device=device, **options)
        observer = OverlapObserver() if c.name == "kvdrive-pipe" else None
        if observer:
            kv.session.add_observer(observer)
        for layer in range(w.num_layers):
            q_obs, keys, values = w.prefill_kv(layer)
            kv.prefill(layer, q_obs.to(device), keys.to(device), values.to(device))
            del q_obs, keys, values
    seconds, before = 0.0, Counter()
    for step in range(total_steps):
        if step == cfg.warmup:
            before = Counter(kv.stats) if c.store else Counter()
        for layer in range(w.num_layers):
            q, k, v = (x.to(device) for x in w.step(step, layer))
            t0 = time.perf_counter()
            kv.decode(layer, q, k, v)
            if sync:
                torch.cuda.synchronize(device)
            if step >= cfg.warmup:
                seconds += time.perf_counter() - t0
    if not c.store:
        return seconds, Counter(), 0, 0, None
    _note_calibration(where, kv.session)
    stats = _delta(Counter(kv.stats), before)
    bb, used = kv.session.block_bytes, _cache_bytes_in_use(kv.session)
    overlap = observer.overlap if observer else None
    kv.close()
    return seconds, stats, bb, used, overlap


def _attention_side_by_side(workload, configs: list[Config], dram: int, kv_bytes: int, steps: int,
                            cfg: BenchConfig) -> dict:
    """(b)'s DRAM-tier tokens/s of ``configs`` decoding side by side: one session each on one
    store of ``len(configs)`` times the tier and the SSD cap, every step taken by each
    session in turn (the order reversed every other step), the same queries and keys fed
    to all. A slow spell of this shared host then falls on every configuration alike."""
    from kvdrive_client import connect  # noqa: PLC0415
    from kvdrive_client.engine import SparseKV  # noqa: PLC0415

    w, n = workload, len(configs)
    with connect(None, dram=f"{n * dram >> 20}M", ssd_max=f"{(n * 2 * kv_bytes + (1 << 30)) >> 20}M") as store, \
            contextlib.ExitStack() as stack:
        sessions = []
        for c in configs:
            kv = SparseKV(store, w.shape, batch=w.batch, device=cfg.device, **_options(c, cfg, w.batch))
            stack.callback(kv.close)
            sessions.append(kv)
        for layer in range(w.num_layers):
            q_obs, keys, values = (x.to(cfg.device) for x in w.prefill_kv(layer))
            for kv in sessions:
                kv.prefill(layer, q_obs, keys, values)
            del q_obs, keys, values
        fed: list = []  # one step's inputs per layer, the same for every session

        def make_inputs(step: int) -> None:
            fed[:] = [tuple(x.to(cfg.device) for x in w.step(step, layer)) for layer in range(w.num_layers)]

        def take_step(j: int, _step: int) -> None:
            for layer, (q, k, v) in enumerate(fed):
                sessions[j].decode(layer, q, k, v)

        seconds = in_turns(n, cfg.warmup + steps, cfg.warmup, take_step, make_inputs)
    return {"tier": "dram", "tokens_per_s": {c.name: w.batch * steps / t for c, t in zip(configs, seconds)}}


def _attention_profile(workload, store, steps: int) -> tuple[tuple, int, float]:
    """Per-head windows for the attention-only workload, from its own trace on a held-out seed (two rows)."""
    from kvdrive_client.engine import SparseKV  # noqa: PLC0415

    w = replace(workload, seed=workload.seed + 1000, batch=PROFILE_SEQUENCES)
    kv = SparseKV(store, w.shape, batch=w.batch, budget=BUDGET,
                  page_size=PAGE_SIZE, pipeline=False)
    tracer = TraceObserver()
    kv.session.add_observer(tracer)
    for layer in range(w.num_layers):
        q_obs, keys, values = w.prefill_kv(layer)
        kv.prefill(layer, q_obs, keys, values)
        del q_obs, keys, values
    for step in range(steps):
        for layer in range(w.num_layers):
            kv.decode(layer, *w.step(step, layer))
    prof = _profile_from_session(tracer, kv.session, "attention-only", w.context_tokens)
    kv.close()
    return tuple(tuple(x) for x in prof.windows), prof.used_bytes, prof.shrink


def run_workloads_bc(cfg: BenchConfig, configs: list[Config], rows: list[Row], info: dict) -> None:
    from kvdrive.tools.decode_workload import DESCRIPTION, SyntheticAttention, calibrate_alpha  # noqa: PLC0415
    from kvdrive_client import connect  # noqa: PLC0415

    base = SyntheticAttention.llama3_8b(num_layers=cfg.layers_b, batch=cfg.batch_b, context_tokens=cfg.context_b,
                                        seed=cfg.seed)
    target = info.get("a_overlap")
    if target is not None:
        _note(f"workload b: calibrating query locality to workload a's overlap {target:.3f}")
        cal = calibrate_alpha(target, base, budget=BUDGET, index_kind=AttachConfig().index)
        base = replace(base, alpha=cal.alpha)
    else:
        _note(f"workload b: query locality alpha {base.alpha:g}, the workload's default: workload a did not run, so "
              "there is no real model's selection overlap to calibrate it to")
    info["b_alpha"] = base.alpha
    info["b_alpha_calibrated"] = target is not None
    info["b_description"] = DESCRIPTION
    kv_bytes = 2 * base.num_layers * base.batch * base.num_kv_heads * base.context_tokens * base.head_dim * 2
    info["b_kv_bytes"] = kv_bytes
    info["b_layers"] = base.num_layers
    steps = cfg.steps_b
    tiers = {"dram": int(kv_bytes * 1.25) + (64 << 20), "dram+ssd": kv_bytes // 2}
    ssd_max = f"{(2 * kv_bytes + (1 << 30)) >> 20}M"
    windows = None
    if "b" in cfg.workloads:
        # A configuration's tiers run back to back, each on a fresh daemon, so the DRAM+SSD
        # row it is compared with ran minutes, not the whole table, after its DRAM row:
        # this host's speed drifts by several percent over tens of minutes.
        b_rows = []
        for c in [c for c in configs if not c.a_only]:
            for tier, dram in tiers.items():
                if not c.store and tier != "dram":
                    continue
                with connect(None, dram=f"{dram >> 20}M", ssd_max=ssd_max) if c.store else nullcontext() as store:
                    if windows is None and c.profile:
                        _note("workload b: profiling windows on a held-out seed")
                        windows, info["b_profile_bytes"], info["b_profile_shrink"] = _attention_profile(base, store, steps)
                    _note(f"workload b: {tier}: {c.name} ({base.num_layers} layers x {base.context_tokens} tokens x batch {base.batch})")
                    seconds, stats, bb, used, overlap = _run_attention(base, c, store, steps, windows, cfg,
                                                                       f"workload b: {tier}: {c.name}", cfg.device)
                row = _row("b", c, tier, base.batch, steps, seconds, stats, bb, used)
                row.overlap = overlap
                b_rows.append(row)
        rows += sorted(b_rows, key=lambda r: list(tiers).index(r.tier) if r.tier in tiers else 0)  # the table: tier by tier
        side = [c for name in SIDE_BY_SIDE_B for c in configs if c.name == name]
        if len(side) == len(SIDE_BY_SIDE_B):
            _note(f"workload b: dram: {', '.join(c.name for c in side)} side by side")
            _release_freed_memory()
            info["b_side_by_side"] = _attention_side_by_side(base, side, tiers["dram"], kv_bytes, steps, cfg)
    if "c" in cfg.workloads:
        dram = kv_bytes // 3
        info["c_dram_bytes"] = dram
        with connect(None, dram=f"{dram >> 20}M", ssd_max=ssd_max) as store:
            for c in configs:
                if c.name != "kvdrive+pipe":
                    continue
                _note(f"workload c: dram {dram >> 20} MiB for {kv_bytes >> 20} MiB of KV: {c.name}")
                seconds, stats, bb, used, _ = _run_attention(base, c, store, steps, windows, cfg, f"workload c: {c.name}",
                                                             cfg.device)
                rows.append(_row("c", c, "dram/3", base.batch, steps, seconds, stats, bb, used))


# ---------------------------------------------------------------- report


def _find(rows: list[Row], workload: str, config: str, tier: str | None = None, batch: int | None = None) -> Row | None:
    for r in rows:
        if r.workload == workload and r.config == config and (tier is None or r.tier == tier) and (batch is None or r.batch == batch):
            return r
    return None


def _best_kvdrive(rows: list[Row], workload: str, tier: str, batch: int | None) -> Row | None:
    """The faster of KVDrive's uniform-window rows with the pipeline on and off (both are KVDrive)."""
    found = [r for r in (_find(rows, workload, c, tier, batch) for c in ("kvdrive+pipe", "kvdrive-pipe")) if r]
    return max(found, key=lambda r: r.tokens_per_s) if found else None


def target_lines(rows: list[Row], info: dict) -> list[str]:
    out = []
    kv, shadow, x0 = _find(rows, "b", "kvdrive+pipe", "dram"), _find(rows, "b", "shadowkv", "dram"), _find(rows, "b", "quest", "dram")
    best = _best_kvdrive(rows, "b", "dram", None)
    side = info.get("b_side_by_side")
    if best and shadow:
        ratio = best.tokens_per_s / shadow.tokens_per_s
        line = (f"(b) dram: kvdrive ({best.config}, the faster of pipeline on/off) {best.tokens_per_s:.2f} "
                f"tok/s / shadowkv {shadow.tokens_per_s:.2f} = {ratio:.2f}x")
        if side:
            out.append(f"info: {line} (rows run one after the other)")
        else:
            out.append(f"target 1: {line}, target >= {TARGET_SPEEDUP_VS_SHADOWKV:g}x: "
                       f"{verdict(ratio >= TARGET_SPEEDUP_VS_SHADOWKV)}")
    if side:
        tps, name = side["tokens_per_s"], SIDE_BY_SIDE_B[1]
        ratio = tps[name] / tps["shadowkv"]
        out.append(f"target 1: (b) dram, side by side: kvdrive ({name}) {tps[name]:.2f} "
                   f"tok/s / shadowkv {tps['shadowkv']:.2f} = {ratio:.2f}x, target >= {TARGET_SPEEDUP_VS_SHADOWKV:g}x: "
                   f"{verdict(ratio >= TARGET_SPEEDUP_VS_SHADOWKV)}")
    if kv and x0:
        mine, base = kv.bytes_per_step_dram + kv.bytes_per_step_ssd, x0.bytes_per_step_dram + x0.bytes_per_step_ssd
        ratio = mine / base if base else math.inf
        out.append(f"target 1: (b) dram: kvdrive fetched {mine / 2**20:.2f} MiB/step / x0 (quest) {base / 2**20:.2f} MiB/step = "
                   f"{ratio:.3f}x, target <= {TARGET_BYTES_VS_X0:g}x: {verdict(ratio <= TARGET_BYTES_VS_X0)}")
    ssd = _find(rows, "b", "kvdrive+pipe", "dram+ssd")
    if kv and ssd:
        ratio = ssd.tokens_per_s / kv.tokens_per_s
        out.append(f"target 2: (b) kvdrive dram+ssd {ssd.tokens_per_s:.2f} tok/s / dram {kv.tokens_per_s:.2f} = {ratio:.2f}x, "
                   f"target >= {TARGET_SSD_VS_DRAM:g}x: {verdict(ratio >= TARGET_SSD_VS_DRAM)}")
    for r in [x for x in rows if x.config in ("kvdrive+pipe",) and x.tier == "dram"]:
        stages = {"select": r.select_ms, "hit/miss": r.hitmiss_ms, "fetch": r.fetch_ms, "compute": r.compute_ms}
        longest = max(stages, key=stages.get)
        serial = sum(stages.values())
        ok = r.attn_ms <= TARGET_PIPELINE_VS_LONGEST * stages[longest] and r.attn_ms < serial
        out.append(f"target 3: ({r.workload}) batch {r.batch} pipeline: attention layers {r.attn_ms:.1f} ms/step vs longest "
                   f"stage {longest} {stages[longest]:.1f} ms ({r.attn_ms / max(stages[longest], 1e-9):.2f}x, target <= "
                   f"{TARGET_PIPELINE_VS_LONGEST:g}x) and serial sum {serial:.1f} ms: {verdict(ok)}")
    c = _find(rows, "c", "kvdrive+pipe")
    if c and kv:
        ratio = c.tokens_per_s / kv.tokens_per_s
        out.append(f"target 4: (c) {c.tokens_per_s:.2f} tok/s / (b) dram {kv.tokens_per_s:.2f} = {ratio:.2f}x, "
                   f"target >= {TARGET_C_VS_B:g}x: {verdict(ratio >= TARGET_C_VS_B)}")
    for w in ("a", "b"):
        if f"{w}_profile_shrink" in info:
            shrink = info[f"{w}_profile_shrink"]
            out.append(f"info: ({w}) profile: per-head curves trusted at shrink {shrink:.2f}"
                       + (" (no per-head choice beat one window on held-out calibration data)" if shrink == 0 else ""))
    for r in [x for x in rows if x.config == "kvdrive-profile+pipe"]:
        u = _find(rows, r.workload, "kvdrive+pipe", r.tier, r.batch)
        if u:
            mine, theirs = r.bytes_per_step_dram + r.bytes_per_step_ssd, u.bytes_per_step_dram + u.bytes_per_step_ssd
            change = (mine - theirs) / theirs if theirs else 0.0
            out.append(f"target 5: ({r.workload}) batch {r.batch} {r.tier}: profile fetched {mine / 2**10:.1f} KiB/step vs "
                       f"uniform {theirs / 2**10:.1f} KiB/step ({change:+.1%}) at cache bytes {r.cache_bytes} vs {u.cache_bytes}: "
                       f"{verdict(mine <= TARGET_PROFILE_VS_UNIFORM * theirs)}")
    for batch in sorted({r.batch for r in rows if r.workload == "a"}):
        k, s = _best_kvdrive(rows, "a", "dram", batch), _find(rows, "a", "shadowkv", "dram", batch)
        if k and s:
            line = (f"(a) batch {batch}: kvdrive ({k.config}) {k.tokens_per_s:.2f} tok/s vs shadowkv {s.tokens_per_s:.2f}"
                    f" ({k.tokens_per_s / s.tokens_per_s:.2f}x)")
            ok = k.tokens_per_s >= TARGET_A_VS_SHADOWKV * s.tokens_per_s
            out.append(f"target 6: {line}, target >= {TARGET_A_VS_SHADOWKV:g}x: {verdict(ok)}" if batch == TARGET_A_BATCH else f"info: {line}")
    side = info.get("a_index_side_by_side", [])
    for r in [x for x in rows if x.config == "kvdrive-hierarchical+pipe"]:
        k = _find(rows, r.workload, "kvdrive+pipe", r.tier, r.batch)
        if k:
            line = (f"({r.workload}) batch {r.batch} {r.tier}: kvdrive+pipe with the {AttachConfig().index.value} index "
                    f"{k.tokens_per_s:.2f} tok/s vs the hierarchical index {r.tokens_per_s:.2f} "
                    f"({k.tokens_per_s / r.tokens_per_s:.2f}x)")
            if r.workload == "a" and not side:
                ok = k.tokens_per_s >= TARGET_INDEX_SPEED * r.tokens_per_s
                out.append(f"target index: {line}, target >= {TARGET_INDEX_SPEED:g}x: {verdict(ok)}")
            else:
                out.append(f"info: {line}" + (" (rows run one after the other)" if r.workload == "a" else ""))
    for p in side:
        mine, hier = p["tokens_per_s"]["kvdrive+pipe"], p["tokens_per_s"]["kvdrive-hierarchical+pipe"]
        out.append(f"target index: (a) batch {p['batch']} {p['tier']}, side by side: kvdrive+pipe with the "
                   f"{AttachConfig().index.value} index {mine:.2f} tok/s vs the hierarchical index {hier:.2f} "
                   f"({mine / hier:.2f}x), target >= {TARGET_INDEX_SPEED:g}x: {verdict(mine >= TARGET_INDEX_SPEED * hier)}")
    for p in info.get("a_sketch_side_by_side", []):
        mine, old = p["tokens_per_s"]["kvdrive+pipe"], p["tokens_per_s"]["kvdrive-rank16+pipe"]
        out.append(f"target sketch: (a) batch {p['batch']} {p['tier']}, side by side: kvdrive+pipe with the default "
                   f"sketch {mine:.2f} tok/s vs the rank-16 int8/int4 sketch {old:.2f} ({mine / old:.2f}x), target >= "
                   f"{TARGET_SKETCH_SPEED:g}x: {verdict(mine >= TARGET_SKETCH_SPEED * old)}")
    a_ov, b_ov = info.get("a_overlap"), next((r.overlap for r in rows if r.workload == "b" and r.overlap is not None), None)
    if a_ov is not None and b_ov is not None:
        out.append(f"locality: previous-step selection overlap (b) {b_ov:.3f} vs (a) SmolLM2 {a_ov:.3f}: gap {abs(a_ov - b_ov):.3f}, "
                   f"target <= {TARGET_OVERLAP_GAP:g}: {verdict(abs(a_ov - b_ov) <= TARGET_OVERLAP_GAP)}")
    return out


def render(rows: list[Row], info: dict) -> str:
    head = ("workload", "config", "tier", "batch", "tok/s", "vs best base", "MiB/step dram", "MiB/step ssd", "hit rate",
            "select ms", "hit/miss ms", "fetch ms", "wait ms", "compute ms", "attn ms", "step ms", "dloss", "kl", "top1")
    body = []
    for r in rows:
        bases = [x.tokens_per_s for x in rows if x.workload == r.workload and x.batch == r.batch and x.config in BASELINES
                 and x.tier in (r.tier, "-")]
        best = max(bases) if bases else None
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        body.append((r.workload, r.config, r.tier, str(r.batch), f"{r.tokens_per_s:.2f}",
                     f"{r.tokens_per_s / best:.2f}x" if best else "-", f"{r.bytes_per_step_dram / 2**20:.2f}",
                     f"{r.bytes_per_step_ssd / 2**20:.2f}", fmt(r.hit_rate, ".3f"), f"{r.select_ms:.1f}", f"{r.hitmiss_ms:.1f}",
                     f"{r.fetch_ms:.1f}", f"{r.fetch_wait_ms:.1f}", f"{r.compute_ms:.1f}", f"{r.attn_ms:.1f}", f"{r.step_ms:.1f}", fmt(r.dloss, "+.3f"),
                     fmt(r.kl, ".3f"),
                     fmt(r.top1, ".3f")))
    lines = text_table(head, body, right=set(range(3, len(head))))
    lines.append("")
    if "b_description" in info:
        lines.append(f"(b)/(c): {info['b_description']}")
        lines.append(f"(b): {info['b_layers']} layers of Llama-3-8B's attention shape, {info['b_kv_bytes'] / 2**30:.2f} GiB of KV"
                     + f", query locality alpha {info['b_alpha']:.4f}"
                     + ("" if info["b_alpha_calibrated"] else " (not calibrated: workload a did not run)"))
    lines.append("times are per decode step over all layers; select, hit/miss, fetch and compute are each stage's own time"
                 " (fetch: the daemon's time on the gets plus landing the pages in the cache); wait: what the main thread"
                 " waited for the gets (attending to the cached pages meanwhile); attn: wall time inside the"
                 " attention layers; step: wall time of the whole step (the model's other layers too in (a));"
                 " vs best base: tok/s over the fastest baseline (dense, whole-layer, quest, shadowkv) of the same"
                 " workload, batch and tier")
    lines.append(f"{os.cpu_count()} CPUs; kernels: {cpu_kernels.VECTOR_WIDTH}")
    lines.append("")
    lines += target_lines(rows, info)
    return "\n".join(lines)


def _chart(rows: list[Row], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    groups = sorted({(r.workload, r.batch, r.tier) for r in rows if r.tier != "-"})
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.6 * len(groups)), squeeze=False)
    for ax, (wl, batch, tier) in zip(axes[:, 0], groups):
        sel = [r for r in rows if r.workload == wl and r.batch == batch and r.tier in (tier, "-")]
        ax.barh([r.config for r in sel], [r.tokens_per_s for r in sel], color="#4a7ab5")
        ax.set_title(f"workload {wl}, batch {batch}, {tier}: decode tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- CLI


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = BenchConfig.from_args(args)
    except InputError as exc:
        print(f"kvdrive-bench decode: {exc}", file=sys.stderr)
        return 2
    configs = configurations(pipeline_variants=not cfg.quick)
    if args.configs:
        known = [c.name for c in configurations()]
        unknown = [n for n in args.configs if n not in known]
        if unknown:
            print(f"kvdrive-bench decode: --configs: unknown {', '.join(unknown)}; choose from {', '.join(known)}",
                  file=sys.stderr)
            return 2
        configs = [c for c in configurations() if c.name in args.configs]
    rows: list[Row] = []
    info: dict = {}
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)  # measurement only; the front thread of the pipeline sets its own
    try:
        if "a" in cfg.workloads:
            run_workload_a(cfg, configs, rows, info)
            ov = [r.overlap for r in rows if r.workload == "a" and r.overlap is not None]
            if ov:
                info["a_overlap"] = float(np.mean(ov))
        if {"b", "c"} & set(cfg.workloads):
            _release_freed_memory()
            run_workloads_bc(cfg, configs, rows, info)
    except InputError as exc:
        print(f"kvdrive-bench decode: {exc}", file=sys.stderr)
        return 2
    print(render(rows, info))
    print(f"\n(ran in {time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.png:
        _chart(rows, args.png)
    return 0
