"""One generation's KV state: prefill into the store, sparse decode out of it.

A :class:`Session` covers a batch of sequences (left-padded to one length) from
prefill to the end of decode. Per layer it keeps, on the compute device:

- the *local window*: the last ``local_tokens`` tokens (from a page boundary on),
- a :class:`~kvdrive_client.device_cache.DeviceCache` of pages, and
- a :class:`~kvdrive_client.selectors.Selector` over every complete page.

Every complete page is in ``kvstored`` (one store sequence per batch row). A
decode step per layer: select pages, look them up in the device cache, fetch the
misses with one sparse get per row, attend exactly over sink + selected pages +
local window. Pages completed during decode are indexed at once and written to
the store at the end of the step, all layers in one put per row.
"""

from __future__ import annotations

import logging
import math
import queue
import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from kvdrive.kernels import cpu as cpu_kernels
from kvdrive.kernels import reference as ref
from kvdrive.layout.geometry import Geometry
from kvdrive_client.config import AttachConfig
from kvdrive_client.device_cache import DeviceCache, EvictionPolicy
from kvdrive_client.selectors import IndexKind, Selector, make_selector
from kvdrive_client.errors import NotFoundError
from kvdrive_client.store import Sequence, StoreClient
from kvdrive_client.timeline import Timeline

log = logging.getLogger(__name__)

_TORCH_TO_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype
    scaling: float

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of one (layer, KV head): its K and V, as stored and cached."""
        return Geometry(1, 1, self.head_dim, _TORCH_TO_DTYPE[self.dtype], page_size).block_bytes


class Observer:
    """Hooks for measurement tools (fidelity, cache traces); the defaults do nothing.

    Keys are post-RoPE, ``[B, H, T, D]``; ``valid`` marks real (unpadded) tokens.
    """

    def on_prefill(self, layer: int, keys: torch.Tensor, valid: torch.Tensor) -> None:
        pass

    def on_page(self, layer: int, page: int, keys: torch.Tensor, valid: torch.Tensor) -> None:
        pass

    def on_seed(self, layer: int, ranked: torch.Tensor) -> None:
        """Pages between sink and local window, most important first ``[B, H, n]``: the cache is seeded
        with as many of them (after the sink pages) as each head's window holds."""

    def on_select(self, layer: int, step: int, query: torch.Tensor, chosen: torch.Tensor, selectable: torch.Tensor,
                  selector: "Selector") -> None:
        """``chosen`` ``[B, H, k]`` pages (-1 none) picked among ``selectable`` ``[B, P]``."""


class LayerState:
    def __init__(self) -> None:
        self.prefill: tuple[torch.Tensor, torch.Tensor] | None = None
        self.local_k: torch.Tensor | None = None
        self.local_v: torch.Tensor | None = None
        self.local_start = 0
        self.num_tokens = 0
        self.num_pages = 0  # complete pages: indexed and (to be) stored
        self.selector: Selector | None = None
        self.cache: DeviceCache | None = None


class Session:
    def __init__(self, cfg: AttachConfig, shape: ModelShape, store: StoreClient, batch: int, device: torch.device,
                 stats: Counter) -> None:
        self.cfg = cfg
        self.shape = shape
        self.store = store
        self.batch = batch
        self.device = device
        self.stats = stats
        self.layers = [LayerState() for _ in range(shape.num_layers)]
        self.valid: torch.Tensor | None = None
        self.step = 0
        self.geometry = Geometry(shape.num_layers, shape.num_kv_heads, shape.head_dim, _TORCH_TO_DTYPE[shape.dtype], cfg.page_size)
        self.block_bytes = self.geometry.block_bytes
        self.seqs: list[Sequence] = []
        # Reuse: pages [0, base_pages) of each row live in a kept, token-named prefix
        # sequence; pages from base_pages on (and all decode pages) in this session's own.
        self.base_names: list[str] | None = None
        self.base_seqs: list[Sequence] = []
        self.base_pages = 0
        self.restored = False
        self._page_parts: dict[int, list] = {}
        self._staging: list = [None, None]  # double-buffered: one fetch lands while the previous is read
        self._closed = False
        self.timeline = Timeline(enabled=cfg.trace is not None)
        self._front: ThreadPoolExecutor | None = None
        self.window = cfg.window if cfg.window is not None else CALIBRATION_START_WINDOW
        self.micro_batch = cfg.micro_batch or batch
        self.calibration: str | None = None  # what warm-up calibration chose, once it has (also logged)
        self._tuning = _Tuning(self, cfg, batch)
        self._step_start = 0.0
        self._work: tuple[torch.Tensor, torch.Tensor] | None = None
        self._gather_staging: torch.Tensor | None = None
        self.observers: list[Observer] = []
        self._selectable_key: tuple | None = None
        self._selectable_mask: torch.Tensor | None = None
        # One get per layer names each block's sequence, where the daemon takes that.
        self._get_seqs = bool(store.hello().get("get_seqs"))
        if not self._get_seqs:
            log.info("kvstored at %s does not take gets across sequences: one get per row and sequence",
                     store.address)
        if cfg.overlap_fetch and device.type != "cpu":
            log.info("overlap_fetch: attention on %s waits for each fetch and runs in one pass "
                     "(attending while misses are fetched is implemented for the CPU)", device.type)

    # ------------------------------------------------------------ transformers Cache hooks

    def seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].num_tokens

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ls = self.layers[layer]
        q_len = key.shape[2]
        if ls.selector is None:
            if ls.prefill is not None:
                raise RuntimeError("KVDrive prefill runs once per session")
            if self.restored:
                past_k, past_v = self._load_prefix(layer)
                key, value = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
            ls.prefill = (key, value)
            ls.num_tokens = key.shape[2]
            self.stats["prefill_tokens"] += q_len * (layer == 0)
            return key, value
        if q_len != 1:
            raise ValueError(
                f"KVDrive decodes one token per step after prefill (got {q_len} tokens at layer {layer}); "
                "start a new generate() for a new prompt"
            )
        with self.decode_threads():
            ls.local_k = torch.cat([ls.local_k, key], dim=2)
            ls.local_v = torch.cat([ls.local_v, value], dim=2)
        ls.num_tokens += 1
        return ls.local_k, ls.local_v

    # ------------------------------------------------------------ prefill

    def _valid_from_mask(self, mask: torch.Tensor | None, length: int) -> torch.Tensor:
        if mask is None:
            return torch.ones(self.batch, length, dtype=torch.bool, device=self.device)
        row = mask[:, 0, -1, :length]
        return row if row.dtype == torch.bool else row == 0

    def finish_prefill(self, layer: int, query: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Index, store and cache one layer after its dense prefill attention ran."""
        t0 = time.perf_counter()
        ls = self.layers[layer]
        keys, values = ls.prefill
        ls.prefill = None
        cfg, sh = self.cfg, self.shape
        b, h, t, d = keys.shape
        s = cfg.page_size
        self.valid = self._valid_from_mask(mask, t)
        if layer == 0:
            self._create_sequences()
        num_pages = t // s
        ls.num_pages = num_pages
        for ob in self.observers:
            ob.on_prefill(layer, keys[:, :, : num_pages * s], self.valid[:, : num_pages * s])
        ls.selector = make_selector(cfg.index, s, sh.scaling, **self._selector_options())
        q = query.reshape(b, h, sh.group, query.shape[2], d)
        cluster = ls.selector.build(keys, self.valid, q) if num_pages else None
        if num_pages == 0:
            ls.selector.build(keys[:, :, :0], self.valid[:, :0], q[:, :, :, :0])
        importance = self._importance(query, keys, t, num_pages)
        if num_pages:
            self._put_layer(layer, keys, values, num_pages, cluster, importance)
        first_local = self._first_local_page(t, num_pages)
        ls.local_start = first_local * s
        ls.local_k = keys[:, :, ls.local_start :].clone()
        ls.local_v = values[:, :, ls.local_start :].clone()
        capacity, per_head = self._cache_capacity(layer, first_local)
        ls.cache = DeviceCache(b, h, capacity, s, d, keys.dtype, self.device, cfg.eviction, reuse=self.window != 0)
        ls.cache.set_head_capacity(per_head)
        if ls.cache.reuse:
            self._seed_cache(ls, keys, values, importance, first_local)
        if self.observers and num_pages:
            sink = min(cfg.sink_pages, first_local)
            ranked = importance[:, :, sink:first_local].argsort(dim=2, descending=True, stable=True) + sink
            for ob in self.observers:
                ob.on_seed(layer, ranked)
        self.stats["prefill_ms"] += (time.perf_counter() - t0) * 1e3

    def _selector_options(self) -> dict:
        if self.cfg.index is IndexKind.HIERARCHICAL:
            return {"pages_per_cluster": self.cfg.pages_per_cluster, "candidate_factor": self.cfg.candidate_factor}
        if self.cfg.index is IndexKind.LOWRANK:
            return {"rank": self.cfg.lowrank_rank(self.shape.head_dim), "pages_per_cluster": self.cfg.pages_per_cluster}
        return {}

    def _first_local_page(self, num_tokens: int, num_pages: int) -> int:
        return max(0, min(num_pages, (num_tokens - self.cfg.local_tokens) // self.cfg.page_size))

    def _cache_capacity(self, layer: int, first_local: int) -> tuple[int, torch.Tensor | None]:
        """Slots per (row, KV head) for a context of ``first_local`` pages, and per-head limits (or None)."""
        sink = min(self.cfg.sink_pages, first_local)
        k = self.cfg.pages_to_select(first_local - sink)
        if self.cfg.windows is not None:
            per_head = torch.tensor([math.ceil(w * k) + sink for w in self.cfg.windows[layer]], dtype=torch.long)
            per_head = per_head.clamp_min(max(k + sink, 1))
            return int(per_head.max()), per_head
        if self.cfg.cache_bytes is not None:
            per_page = self.shape.page_bytes(self.cfg.page_size)
            slots = self.cfg.cache_bytes // (per_page * self.batch * self.shape.num_kv_heads * self.shape.num_layers)
            return max(int(slots), k + sink, 1), None
        if self.window == 0:
            return max(1, k + sink), None
        return max(1, math.ceil(self.window * k) + sink), None

    def _importance(self, query: torch.Tensor, keys: torch.Tensor, t: int, num_pages: int) -> torch.Tensor:
        """SnapKV-style: attention of the last prompt tokens, summed per page and KV head."""
        sh = self.shape
        # The query rows are the last q_len positions (all of them on a fresh prefill).
        obs = min(self.cfg.obs_window, query.shape[2])
        b, h, _, d = keys.shape
        q = query[:, :, query.shape[2] - obs :].reshape(b, h, sh.group, obs, d)
        logits = torch.einsum("bhgod,bhtd->bhgot", q, keys) * sh.scaling
        pos_q = torch.arange(t - obs, t, device=keys.device)
        allowed = (torch.arange(t, device=keys.device)[None, :] <= pos_q[:, None])[None, None, None]
        allowed = allowed & self.valid[:, None, None, None, :]
        probs = torch.softmax(logits.masked_fill(~allowed, ref.NEG_INF).float(), dim=-1).nan_to_num(0.0)
        per_token = probs.sum(dim=(2, 3))  # [B, H, T]
        s = self.cfg.page_size
        return per_token[:, :, : num_pages * s].reshape(b, h, num_pages, s).sum(dim=-1)

    def _seed_cache(self, ls: LayerState, keys, values, importance, first_local: int) -> None:
        sink = min(self.cfg.sink_pages, first_local)
        n = min(ls.cache.capacity, first_local)
        if n == 0:
            return
        score = importance[:, :, :first_local].clone()
        score[:, :, :sink] = float("inf")  # sink pages always sit in the cache
        pages = score.topk(n, dim=2).indices
        b, h, t, d = keys.shape
        s = self.cfg.page_size
        kp = keys[:, :, : first_local * s].reshape(b, h, first_local, s, d)
        vp = values[:, :, : first_local * s].reshape(b, h, first_local, s, d)
        idx = pages[..., None, None].expand(-1, -1, -1, s, d)
        k_seed, v_seed = kp.gather(2, idx), vp.gather(2, idx)
        if ls.cache.head_capacity is not None:  # each head seeds as many pages as its own window holds
            beyond = torch.arange(n, device=pages.device)[None, :] >= ls.cache.head_capacity[:, None]
            pages = pages.masked_fill(beyond[None], -1)
        ls.cache.seed(pages, k_seed, v_seed)

    # ------------------------------------------------------------ store I/O

    def _create_sequences(self) -> None:
        for row in range(self.batch):
            name = f"{uuid.uuid4().hex}-{row}"
            self.seqs.append(self.store.create(self.cfg.namespace, name, self.geometry))
        if self.base_names is not None and not self.restored:
            self.base_seqs = [self.store.create(self.cfg.namespace, n, self.geometry, exist_ok=True) for n in self.base_names]

    def try_restore(self, names: list[str], prefix_pages: int) -> bool:
        """Use the stored prefix pages of every row, if all are there; else store them at prefill."""
        self.base_names, self.base_pages = names, prefix_pages
        if prefix_pages == 0:
            return False
        try:
            seqs = [self.store.open(self.cfg.namespace, n) for n in names]
        except NotFoundError:
            return False
        if any(seq.geometry != self.geometry or seq.complete_pages < prefix_pages for seq in seqs):
            return False
        self.base_seqs = seqs
        self.restored = True
        for ls in self.layers:
            ls.num_tokens = prefix_pages * self.cfg.page_size
        self.stats["restored_pages"] += prefix_pages * len(seqs)
        log.info("reusing %d stored prompt pages of %d sequence(s)", prefix_pages, len(seqs))
        return True

    def _load_prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored prefix page of one layer, ``[B, H, P*S, D]`` K and V."""
        sh, s = self.shape, self.cfg.page_size
        p = self.base_pages
        pages = torch.arange(p).expand(self.batch, sh.num_kv_heads, p)
        fetch = self._fetch_submit(layer, 0, pages, torch.ones_like(pages, dtype=torch.bool), slot=0)
        kf, vf = self._fetch_finish(fetch)
        shape = (self.batch, sh.num_kv_heads, p * s, sh.head_dim)
        # copy=True: kf/vf may be views of the staging buffer, which the next fetch reuses.
        return kf.reshape(shape).to(self.device, copy=True), vf.reshape(shape).to(self.device, copy=True)

    def _blocks(self, keys: torch.Tensor, values: torch.Tensor, num_pages: int) -> np.ndarray:
        """``[B, H, P*S, D]`` K and V -> ``[B, H, P, block_bytes]`` bytes (K then V per block)."""
        b, h, _, d = keys.shape
        s = self.cfg.page_size
        kv = torch.stack([keys[:, :, : num_pages * s].reshape(b, h, num_pages, s, d),
                          values[:, :, : num_pages * s].reshape(b, h, num_pages, s, d)], dim=3)
        return kv.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(b, h, num_pages, -1)

    def _put_layer(self, layer, keys, values, num_pages, cluster, importance) -> None:
        t0 = time.perf_counter()
        blocks = self._blocks(keys, values, num_pages)
        imp = importance.detach().float().cpu().numpy()
        clu = None if cluster is None else cluster.detach().cpu().numpy().astype(np.int32)
        # Pages below base_pages go to the kept prefix sequence (unless they came from it).
        split = min(self.base_pages, num_pages)
        parts = [(self.seqs, split, num_pages)]
        if split and not self.restored:
            parts.append((self.base_seqs, 0, split))
        for seqs, lo, hi in parts:
            if lo == hi:
                continue
            for row, seq in enumerate(seqs):
                self.store.put(seq, [layer], range(lo, hi), blocks[row : row + 1, :, lo:hi],
                               cluster=None if clu is None else clu[row : row + 1, :, lo:hi],
                               importance=imp[row : row + 1, :, lo:hi])
        self.stats["bytes_put"] += blocks.nbytes
        self.stats["put_ms"] += (time.perf_counter() - t0) * 1e3

    def _flush_pages(self) -> None:
        """Write the pages completed in this step, every layer at once, one put per row."""
        for page, parts in sorted(self._page_parts.items()):
            if len(parts) != self.shape.num_layers:
                continue
            t0 = time.perf_counter()
            data = np.stack([p for _, p in sorted(parts, key=lambda x: x[0])], axis=1)  # [B, L, H, bb]
            for row, seq in enumerate(self.seqs):
                self.store.put(seq, range(self.shape.num_layers), [page], data[row][:, :, None, :])
            self.stats["bytes_put"] += data.nbytes
            self.stats["pages_flushed"] += 1
            self.stats["put_ms"] += (time.perf_counter() - t0) * 1e3
            del self._page_parts[page]

    def _staging_buffer(self, slot: int, nbytes: int):
        buf = self._staging[slot]
        if buf is None or buf.size < nbytes:
            if buf is not None:
                self.store.unregister(buf)
            buf = self._staging[slot] = self.store.register(max(nbytes, 1 << 20))
        return buf

    def _fetch_submit(self, layer: int, row0: int, pages: torch.Tensor, miss: torch.Tensor, slot: int) -> "_Fetch | None":
        """Ask the store for the missed pages of rows ``row0 ..``: one sparse get naming each
        block's sequence (a daemon without that: one get per row and sequence, all in flight)."""
        bi, hi, ki = torch.nonzero(miss, as_tuple=True)
        n = len(bi)
        if n == 0:
            return None
        bb = self.block_bytes
        staging = self._staging_buffer(slot, n * bb)
        rows = bi.cpu().numpy() + row0
        page_ids = pages[bi, hi, ki].cpu().numpy()
        blocks = np.stack([np.full(n, layer), hi.cpu().numpy(), page_ids], axis=1)
        in_base = page_ids < self.base_pages
        started = time.perf_counter()
        if self._get_seqs:
            # A row's pages below base_pages are in its stored prompt sequence (a restored
            # prefix is loaded before the session's own sequences exist), the rest in its own.
            uids = np.empty(n, dtype=np.int64)
            for seqs, where in ((self.base_seqs, in_base), (self.seqs, ~in_base)):
                if where.any():
                    uids[where] = np.array([seq.uid for seq in seqs], dtype=np.int64)[rows[where]]
            first = (self.base_seqs if in_base[0] else self.seqs)[int(rows[0])]
            pending = [self.store.get_async(first, blocks, staging, seqs=uids)]
            return _Fetch(layer, pending, n, staging, started)
        pending = []
        for row in np.unique(rows).tolist():
            for seqs, where in ((self.base_seqs, in_base), (self.seqs, ~in_base)):
                at = np.flatnonzero((rows == row) & where)
                if len(at):
                    pending.append(self.store.get_async(seqs[row], blocks[at], staging, dst=at.astype(np.int64) * bb))
        return _Fetch(layer, pending, n, staging, started)

    def _fetch_finish(self, fetch: "_Fetch", mb: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for a fetch; its pages as ``[n, S, D]`` K and V on the compute device.

        On the CPU they are views of the staging buffer, valid until that buffer's
        next fetch: copy them (the cache's ``fill`` does) before then.
        """
        t0 = time.perf_counter()
        replies = [p.wait() for p in fetch.pending]
        t1 = time.perf_counter()
        worked = max(r.get("ms", 0.0) for r in replies) / 1e3
        self.timeline.add("fetch", "daemon", fetch.started, fetch.started + worked, layer=fetch.layer, mb=mb, pages=fetch.n)
        for r in replies:
            self.stats["blocks_dram"] += r["dram"]
            self.stats["blocks_ssd"] += r["ssd"]
        s, d, bb = self.cfg.page_size, self.shape.head_dim, self.block_bytes
        raw = torch.from_numpy(fetch.staging.array[: fetch.n * bb]).view(self.shape.dtype).reshape(fetch.n, 2, s, d)
        raw = raw.to(self.device)
        self.stats["bytes_fetched"] += fetch.n * bb
        self.stats["fetch_wait_ms"] += (t1 - t0) * 1e3
        self.stats["fetch_ms"] += worked * 1e3
        return raw[:, 0], raw[:, 1]

    def _advance(self, layer: int) -> None:
        """Index (and queue for the store) pages completed by the new token; slide the local window."""
        ls = self.layers[layer]
        s = self.cfg.page_size
        while (ls.num_pages + 1) * s <= ls.num_tokens:
            page = ls.num_pages
            lo = page * s - ls.local_start
            k = ls.local_k[:, :, lo : lo + s]
            v = ls.local_v[:, :, lo : lo + s]
            ls.selector.add_page(k, self.valid[:, page * s : (page + 1) * s])
            for ob in self.observers:
                ob.on_page(layer, page, k, self.valid[:, page * s : (page + 1) * s])
            ls.num_pages += 1
            self._page_parts.setdefault(page, []).append((layer, self._blocks(k, v, 1)[:, :, 0]))
        first_local = self._first_local_page(ls.num_tokens, ls.num_pages)
        drop = first_local * s - ls.local_start
        if drop > 0:
            ls.local_k = ls.local_k[:, :, drop:]
            ls.local_v = ls.local_v[:, :, drop:]
            ls.local_start += drop

    def decode_attention(self, layer: int, query: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One layer of one decode step: select, evaluate hits, fetch misses, attend; per micro-batch.

        Inference only: no gradient flows through KVDrive's decode (its stages run on
        two threads, and the cache is updated in place).
        """
        with torch.no_grad(), self.decode_threads():
            return self._decode_attention(layer, query, mask)

    def decode_threads(self):
        """Context for a decode step's own torch ops: on the CPU, one intra-op thread
        (:func:`kvdrive.kernels.cpu.one_torch_thread`; the compiled kernels keep splitting)."""
        return cpu_kernels.one_torch_thread() if self.device.type == "cpu" else nullcontext()

    def _decode_attention(self, layer: int, query: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        t_start = time.perf_counter()
        if layer == 0:
            self._step_start = t_start
        ls = self.layers[layer]
        sh, cfg = self.shape, self.cfg
        b = query.shape[0]
        t = ls.num_tokens
        if layer == 0:
            # Every layer of a step takes the same tokens: the mask is read once per step,
            # and what is derived from it (the selectable pages) is shared by all layers.
            self.valid = self._valid_from_mask(mask, t)
        self._advance(layer)
        s = cfg.page_size
        first_local = ls.local_start // s
        sink = min(cfg.sink_pages, first_local)
        k = cfg.pages_to_select(first_local - sink)
        work = _LayerWork(layer, query[:, :, 0].reshape(b, sh.num_kv_heads, sh.group, sh.head_dim), t, sink, k,
                          self._selectable(t, ls.num_pages, sink, first_local) if k else None)
        if sink + k:
            capacity, per_head = self._cache_capacity(layer, first_local)  # never below sink + k
            if per_head is not None:
                ls.cache.set_head_capacity(per_head)
            ls.cache.grow(capacity)
            ls.cache.reserve_pages(ls.num_pages + 1)
            self._flush_ready()  # a page completed in an earlier step must be in the store before it is fetched
        size = b if self.observers else min(self.micro_batch, b)  # observers see whole batches
        groups = [(lo, min(lo + size, b)) for lo in range(0, b, size)]
        if cfg.pipeline and len(groups) > 1:
            outs = self._run_pipelined(work, groups)
        else:
            outs = [self._run_serial(work, i, lo, hi) for i, (lo, hi) in enumerate(groups)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        self.stats["context_tokens"] += int(self.valid.sum()) * sh.num_kv_heads
        self.stats["layer_ms"] += (time.perf_counter() - t_start) * 1e3
        if layer == sh.num_layers - 1:
            self._flush_ready()
            now = time.perf_counter()
            step_ms = (now - self._step_start) * 1e3
            self.timeline.mark("step", now, step=self.step, ms=step_ms)
            self.stats["step_ms"] += step_ms
            self._tuning.after_step(self.step, step_ms)
            self.step += 1
            self.stats["steps"] += 1
        return out

    # ------------------------------------------------------------ decode stages

    def _select(self, w: "_LayerWork", lo: int, hi: int, lane: str, mb: int):
        """Stage 1: the pages each (row, head) of rows ``[lo, hi)`` attends, and cached pages' scores."""
        t0 = time.perf_counter()
        ls, sh = self.layers[w.layer], self.shape
        whole = (lo, hi) == (0, self.batch)
        selector = ls.selector if whole else ls.selector.rows(lo, hi)
        q = w.query[lo:hi]
        cached = ls.cache.slot_page[lo:hi]
        lookahead = self.cfg.eviction is EvictionPolicy.LOOKAHEAD and ls.cache.reuse
        chosen = torch.arange(w.sink, device=self.device).expand(hi - lo, sh.num_kv_heads, w.sink)
        slot_scores = None
        if w.k:
            picked, scores, slot_scores = selector.select_and_score(q, w.selectable[lo:hi], w.k, cached if lookahead else None)
            # A row with fewer selectable pages than k (padding) gets -1: nothing there.
            picked = picked.masked_fill(scores == ref.NEG_INF, -1)
            if self.observers:
                t_ob = time.perf_counter()
                for ob in self.observers:
                    ob.on_select(w.layer, self.step, q, picked, w.selectable, ls.selector)
                t0 += time.perf_counter() - t_ob  # measurement is not selection time
            chosen = torch.cat([chosen, picked], dim=2)
        if lookahead and slot_scores is None:
            slot_scores = selector.page_scores(q, cached)
        t1 = time.perf_counter()
        self.timeline.add("select", lane, t0, t1, layer=w.layer, mb=mb)
        return chosen, slot_scores, (t1 - t0) * 1e3

    def _place(self, w: "_LayerWork", lo: int, hi: int, chosen, slot_scores, lane: str, mb: int):
        """Stage 2: hit/miss evaluation; the cache's bookkeeping for rows ``[lo, hi)``."""
        t0 = time.perf_counter()
        cache = self.layers[w.layer].cache
        cache = cache if (lo, hi) == (0, self.batch) else cache.rows(lo, hi)
        placement = cache.place(chosen, self.step, slot_scores)
        t1 = time.perf_counter()
        self.timeline.add("hit/miss", lane, t0, t1, layer=w.layer, mb=mb)
        return cache, placement, (t1 - t0) * 1e3

    def _land(self, w: "_LayerWork", mb: int, cache, placement, fetch) -> None:
        """Stage 3 on the main thread: wait for the fetched pages and write them into the cache."""
        if fetch is not None:
            kf, vf = self._fetch_finish(fetch, mb)
            t0 = time.perf_counter()
            cache.fill(placement, kf, vf)
            t1 = time.perf_counter()
            self.timeline.add("fill", "main", t0, t1, layer=w.layer, mb=mb)
            self.stats["fetch_ms"] += (t1 - t0) * 1e3

    def _finish(self, w: "_LayerWork", mb: int, lo: int, hi: int, chosen, cache, placement, fetch,
                landed=None) -> torch.Tensor:
        """Stages 3 and 4 on the main thread: land the fetched pages, then attend.

        With ``overlap_fetch`` (CPU), the cached pages and the local window are attended
        while the fetch is in flight, and the fetched pages after they land.
        ``landed`` runs once the fetched pages are in the cache (the pipeline submits
        the next fetch there: it reuses this fetch's staging buffer).
        """
        if fetch is not None and self.cfg.overlap_fetch and self.device.type == "cpu":
            partial = cpu_kernels.PartialAttention()
            miss = placement.miss
            valid = self._attended_valid(w, lo, hi, chosen)
            self._compute(w, mb, lo, hi, chosen, cache, placement, slots=placement.slots.masked_fill(miss, -1),
                          partial=partial, valid=valid)
            self._land(w, mb, cache, placement, fetch)
            if landed is not None:
                landed()
            return self._compute(w, mb, lo, hi, chosen, cache, placement, slots=placement.slots.masked_fill(~miss, -1),
                                 partial=partial, valid=valid, local=False)
        self._land(w, mb, cache, placement, fetch)
        if landed is not None:
            landed()
        return self._compute(w, mb, lo, hi, chosen, cache, placement)

    def _workspace(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused ``[b, H, >= n, D]`` K and V buffers in the compute dtype (float32 for half models on the CPU)."""
        sh = self.shape
        dtype = torch.float32 if self.device.type == "cpu" and sh.dtype in (torch.float16, torch.bfloat16) else sh.dtype
        if self._work is None or self._work[0].shape[2] < n or self._work[0].shape[0] < b:
            cap = max(n, 64) if self._work is None else max(n, int(self._work[0].shape[2] * 1.25))
            shape = (self.batch, sh.num_kv_heads, cap, sh.head_dim)
            self._work = (torch.empty(shape, dtype=dtype, device=self.device), torch.empty(shape, dtype=dtype, device=self.device))
        return self._work[0][:b, :, :n], self._work[1][:b, :, :n]

    def _attended_valid(self, w: "_LayerWork", lo: int, hi: int, chosen) -> torch.Tensor:
        """Which of rows ``[lo, hi)``'s attended tokens (selected pages, then local window) are real."""
        ls, s = self.layers[w.layer], self.cfg.page_size
        if chosen is not None and self.device.type == "cpu":
            return cpu_kernels.attended_valid(self.valid[lo:hi], chosen, s, ls.local_start, w.t)
        return ref.attended_valid(self.valid[lo:hi], chosen, s, ls.local_start, w.t, self.shape.num_kv_heads)

    def _compute(self, w: "_LayerWork", mb: int, lo: int, hi: int, chosen, cache, placement, slots=None,
                 partial=None, valid=None, local: bool = True) -> torch.Tensor:
        """Stage 4: exact attention over sink + selected pages + local window, for rows ``[lo, hi)``.

        On the CPU it may run in two parts (:meth:`_finish`): ``slots`` are the pages of
        this part (-1 elsewhere), ``local`` whether it takes the local window, ``partial``
        carries the first part's result into the second, and both get the same ``valid``.
        """
        t0 = time.perf_counter()
        ls, sh, s = self.layers[w.layer], self.shape, self.cfg.page_size
        bm = hi - lo
        second = partial is not None and partial.filled
        if valid is None:
            valid = self._attended_valid(w, lo, hi, chosen)
        if chosen is not None and self.device.type == "cpu":
            # Straight from the cache slots: no gathered copy of K and V.
            lk, lv = ls.local_k[lo:hi], ls.local_v[lo:hi]
            if not local:
                lk, lv = lk[:, :, :0], lv[:, :, :0]
            out = cpu_kernels.sparse_attention(w.query[lo:hi], cache.k, cache.v,
                                               placement.slots if slots is None else slots, lk, lv, valid, sh.scaling,
                                               partial).to(w.query.dtype)
        else:
            paged = 0 if chosen is None else chosen.shape[2] * s
            kk, vv = self._workspace(bm, paged + ls.local_k.shape[2])
            if chosen is not None:
                self._gather_staging = cache.gather_into(placement.slots, kk[:, :, :paged], vv[:, :, :paged],
                                                         self._gather_staging)
            kk[:, :, paged:].copy_(ls.local_k[lo:hi])
            vv[:, :, paged:].copy_(ls.local_v[lo:hi])
            q = w.query[lo:hi].to(kk.dtype)
            out = ref.decode_attention(q, kk, vv, valid, sh.scaling).to(w.query.dtype)
        t1 = time.perf_counter()
        self.timeline.add("compute", "main", t0, t1, layer=w.layer, mb=mb)
        self.stats["attention_ms"] += (t1 - t0) * 1e3
        if not second:
            self.stats["attended_tokens"] += int(valid.sum())
        return out.reshape(bm, sh.num_q_heads, 1, sh.head_dim)

    def _count(self, placement, t_select: float, t_place: float) -> None:
        self.stats["hits"] += placement.num_hits
        self.stats["misses"] += placement.num_misses
        self.stats["select_ms"] += t_select
        self.stats["hitmiss_ms"] += t_place

    def _run_serial(self, w: "_LayerWork", mb: int, lo: int, hi: int) -> torch.Tensor:
        if w.sink + w.k == 0:
            return self._compute(w, mb, lo, hi, None, None, None)
        chosen, slot_scores, t_select = self._select(w, lo, hi, "main", mb)
        cache, placement, t_place = self._place(w, lo, hi, chosen, slot_scores, "main", mb)
        self._count(placement, t_select, t_place)
        fetch = self._fetch_submit(w.layer, lo, chosen, placement.miss, slot=0)
        return self._finish(w, mb, lo, hi, chosen, cache, placement, fetch)

    def _front_stages(self, w: "_LayerWork", groups: list[tuple[int, int]], ready: queue.Queue) -> None:
        for i, (lo, hi) in enumerate(groups):
            chosen, slot_scores, t_select = self._select(w, lo, hi, "front", i)
            cache, placement, t_place = self._place(w, lo, hi, chosen, slot_scores, "front", i)
            ready.put((i, lo, hi, chosen, cache, placement, t_select, t_place))

    def _run_pipelined(self, w: "_LayerWork", groups: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Micro-batches through the stages, overlapped.

        A front thread selects and evaluates hits for micro-batch i+1 while the daemon
        serves i's fetch and the main thread attends for the oldest micro-batch whose
        selection is done. The main thread submits a fetch as soon as its selection is
        ready and attends whenever the next selection is not; two fetches are in flight
        at most (two staging buffers).
        The store client's socket is used by the main thread only.
        """
        if w.sink + w.k == 0:
            return [self._compute(w, i, lo, hi, None, None, None) for i, (lo, hi) in enumerate(groups)]
        ready: queue.Queue = queue.Queue()

        def front() -> None:
            try:
                # Grad mode is per thread; selection and cache bookkeeping never need gradients.
                with torch.no_grad():
                    self._front_stages(w, groups, ready)
            except BaseException as exc:  # handed to the main thread, which raises it
                ready.put(exc)

        if self._front is None:
            # One intra-op thread for the front's torch ops: the main thread's attention and
            # the model's own layers already use the cores; two pools would oversubscribe them.
            self._front = ThreadPoolExecutor(1, thread_name_prefix="kvdrive-front",
                                             initializer=torch.set_num_threads, initargs=(1,))
        done = self._front.submit(front)
        outs: list[torch.Tensor | None] = [None] * len(groups)
        inflight: deque = deque()
        try:
            n = 0

            def submit_ready(block: bool) -> None:
                # Submit every selection the front thread has finished (two fetches in flight at most).
                nonlocal n
                while n < len(groups) and len(inflight) < 2:
                    try:
                        item = ready.get() if block and not inflight else ready.get_nowait()
                    except queue.Empty:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    i, lo, hi, chosen, cache, placement, t_sel, t_place = item
                    self._count(placement, t_sel, t_place)
                    fetch = self._fetch_submit(w.layer, lo, chosen, placement.miss, slot=n % 2)
                    inflight.append((i, lo, hi, chosen, cache, placement, fetch))
                    n += 1

            while n < len(groups) or inflight:
                submit_ready(block=True)
                i0, lo, hi, chosen, cache, placement, fetch = inflight.popleft()
                # A selection that finished meanwhile is fetched while this micro-batch attends.
                outs[i0] = self._finish(w, i0, lo, hi, chosen, cache, placement, fetch,
                                        landed=lambda: submit_ready(block=False))
        finally:
            done.result()
        return outs

    def _selectable(self, t: int, num_pages: int, sink: int, first_local: int) -> torch.Tensor:
        """Pages a step may choose: between sink and local window, holding a real token.

        The same for every layer of a step, so it is built once per step.
        """
        key = (t, num_pages, sink, first_local)
        if self._selectable_key != key:
            s = self.cfg.page_size
            sel = torch.zeros(self.batch, num_pages, dtype=torch.bool, device=self.device)
            sel[:, sink:first_local] = True
            sel &= self.valid[:, : num_pages * s].reshape(self.batch, num_pages, s).any(dim=2)
            self._selectable_key, self._selectable_mask = key, sel.contiguous()
        return self._selectable_mask

    def _flush_ready(self) -> None:
        if self._page_parts:
            self._flush_pages()

    # ------------------------------------------------------------ end

    def index_bytes(self) -> int:
        return sum(ls.selector.index_bytes for ls in self.layers if ls.selector is not None)

    def cache_bytes(self) -> int:
        return sum(ls.cache.nbytes for ls in self.layers if ls.cache is not None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stats["index_bytes"] = self.index_bytes()
        self.stats["device_cache_bytes"] = self.cache_bytes()
        if self._front is not None:
            self._front.shutdown(wait=True)
            self._front = None
        for i, buf in enumerate(self._staging):
            if buf is not None:
                self.store.unregister(buf)
                self._staging[i] = None
        if self.cfg.trace:
            log.info("decode timeline written to %s", self.timeline.save(self.cfg.trace))
        if not self.cfg.keep:
            for seq in self.seqs:
                self.store.delete(seq.ns, seq.name)


CALIBRATION_START_WINDOW = 1.0
CALIBRATION_MAX_WINDOW = 16.0
CALIBRATION_WINDOW_STEPS = 8
CALIBRATION_ROUNDS = 2


@dataclass
class _LayerWork:
    """What every stage of one layer's decode step needs."""

    layer: int
    query: torch.Tensor  # [B, H, G, D]
    t: int  # tokens in the context, the new one included
    sink: int
    k: int
    selectable: torch.Tensor | None


@dataclass
class _Fetch:
    layer: int
    pending: list
    n: int
    staging: object
    started: float


class _Tuning:
    """Warm-up calibration of the micro-batch size and the cache window; logs what it chose.

    Micro-batch: after one warm-up step, each candidate size (the batch, its half,
    its quarter, one row) runs one step, twice round; the fastest (by its faster
    step) is kept. Window (``window=None``):
    starts at 1x and grows by half while a step's fetching takes longer than its
    hit/miss evaluation, for at most a few steps (the paper's rule).
    """

    def __init__(self, session: "Session", cfg: AttachConfig, batch: int) -> None:
        self.session = session
        self.tune_window = cfg.window is None
        sizes = sorted({batch, -(-batch // 2), -(-batch // 4), 1}, reverse=True)
        self.candidates = sizes if cfg.micro_batch is None and cfg.pipeline and batch > 1 else []
        self.timed: dict[int, list[float]] = {}
        self._last = Counter()

    def after_step(self, step: int, step_ms: float) -> None:
        s = self.session
        if self.candidates:
            if step >= 1:
                self.timed.setdefault(s.micro_batch, []).append(step_ms)
            todo = [c for c in self.candidates if len(self.timed.get(c, ())) < CALIBRATION_ROUNDS]
            if todo:
                s.micro_batch = min(todo, key=lambda c: (len(self.timed.get(c, ())), self.candidates.index(c)))
            else:
                self.timed = {c: min(v) for c, v in self.timed.items()}
                s.micro_batch = min(self.timed, key=self.timed.get)
                s.calibration = (f"micro-batch {s.micro_batch} of {s.batch} rows (step ms by size: "
                                 + ", ".join(f"{c}: {ms:.1f}" for c, ms in sorted(self.timed.items())) + ")")
                log.info("calibrated %s", s.calibration)
                self.candidates = []
        if self.tune_window:
            fetch = s.stats["fetch_ms"] - self._last["fetch_ms"]
            hitmiss = s.stats["hitmiss_ms"] - self._last["hitmiss_ms"]
            self._last = Counter({"fetch_ms": s.stats["fetch_ms"], "hitmiss_ms": s.stats["hitmiss_ms"]})
            if step + 1 >= CALIBRATION_WINDOW_STEPS or fetch <= hitmiss or s.window >= CALIBRATION_MAX_WINDOW:
                log.info("calibrated cache window: x%g (last step: fetch %.1f ms, hit/miss %.1f ms)", s.window, fetch, hitmiss)
                self.tune_window = False
            else:
                s.window = min(CALIBRATION_MAX_WINDOW, s.window * 1.5)
