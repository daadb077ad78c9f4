"""One generation's KV state: prefill into the store, sparse decode out of it.

A :class:`Session` covers a batch of sequences (left-padded to one length) from
prefill to the end of decode. It orchestrates the stages of
:mod:`kvdrive_client.decode`; per layer it keeps, on the compute device, the local
window (the last ``local_tokens`` tokens, from a page boundary on), a
:class:`~kvdrive_client.device_cache.DeviceCache` of pages and a
:class:`~kvdrive_client.selectors.Selector` over every complete page.

One layer's decode step (:meth:`Session.decode_attention`): the first layer of a
step builds the :class:`~kvdrive_client.decode.state.StepPlan`; every layer then
indexes the page the new token completed, grows its cache to the plan, and runs its
micro-batches through select, place, fetch and attend.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

import torch

from kvdrive.kernels import for_device
from kvdrive_client.config import AttachConfig
from kvdrive_client.decode import plan as planning
from kvdrive_client.decode.fetch import StoreIO
from kvdrive_client.decode.pipeline import Pipeline
from kvdrive_client.decode.prefill import finish_layer
from kvdrive_client.decode.state import Context, LayerState, ModelShape, Observer, StepPlan
from kvdrive_client.decode.tuning import START_MULTIPLIER, Tuning
from kvdrive_client.store import StoreClient
from kvdrive_client.timeline import Timeline

__all__ = ["ModelShape", "Observer", "Session"]

log = logging.getLogger(__name__)


class Session:
    def __init__(self, cfg: AttachConfig, shape: ModelShape, store: StoreClient, batch: int, device: torch.device,
                 stats: Counter) -> None:
        kernels = for_device(device, cfg.kernels)
        self.ctx = Context(cfg, shape, batch, device, kernels, stats, Timeline(enabled=cfg.trace is not None),
                           [LayerState() for _ in range(shape.num_layers)],
                           multiplier=(cfg.cache_multiplier if cfg.cache_multiplier is not None
                                       else START_MULTIPLIER))
        self.io = StoreIO(self.ctx, store)
        self.pipeline = Pipeline(self.ctx, self.io)
        self.tuning = Tuning(self.ctx)
        self.plan: StepPlan | None = None
        self.valid: torch.Tensor | None = None  # [B, >= tokens]: which tokens are real (not padding)
        self._step_start = 0.0
        self._closed = False
        if cfg.overlap_fetch and not kernels.attends_in_parts:
            log.info("overlap_fetch: the %s kernels attend in one pass, after each fetch lands", kernels.name)

    # ------------------------------------------------------------ what tools read

    @property
    def cfg(self) -> AttachConfig:
        return self.ctx.cfg

    @property
    def shape(self) -> ModelShape:
        return self.ctx.shape

    @property
    def batch(self) -> int:
        return self.ctx.batch

    @property
    def stats(self) -> Counter:
        return self.ctx.stats

    @property
    def kernels(self):
        return self.ctx.kernels

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block: one page of one (layer, KV head), K and V."""
        return self.io.block_bytes

    @property
    def step(self) -> int:
        return self.ctx.step

    @property
    def micro_batch(self) -> int:
        return self.tuning.micro_batch

    @property
    def calibration(self) -> str | None:
        """What warm-up calibration chose, once it has (also logged)."""
        return self.tuning.calibration

    @property
    def cache_multiplier(self) -> float:
        """Device cache per (layer, KV head) as a multiple of a step's selection (calibrated or given)."""
        return self.ctx.multiplier

    def fold_counts(self) -> Counter:
        """The stats, with the figures still on the device added (a copy to the host)."""
        self.ctx.counts.fold(self.stats)
        return self.stats

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer``'s hooks from now on (a measurement tool's view of prefill and decode)."""
        self.ctx.observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        self.ctx.observers.remove(observer)

    def num_pages(self, layer: int) -> int:
        """Complete pages of a layer: indexed and (to be) stored."""
        return self.ctx.layers[layer].num_pages

    def local_window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A layer's local window: K and V ``[B, H, L, D]`` and the position of its first token."""
        window = self.ctx.layers[layer].window
        return *window.linear(), window.start

    def cache(self, layer: int):
        """A layer's device cache (None before its prefill)."""
        return self.ctx.layers[layer].cache

    def prefill_pending(self, layer: int) -> bool:
        """Whether a layer holds prefill K/V waiting for :meth:`finish_prefill`."""
        return self.ctx.layers[layer].prefill is not None

    # ------------------------------------------------------------ transformers Cache hooks

    def seq_length(self, layer: int = 0) -> int:
        return self.ctx.layers[layer].num_tokens

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ls = self.ctx.layers[layer]
        q_len = key.shape[2]
        if ls.selector is None:
            if ls.prefill is not None:
                raise RuntimeError("KVDrive prefill runs once per session")
            if self.io.restored:
                past_k, past_v = self.io.load_prefix(layer)
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
        self.append(key, value, layer)
        return ls.window.k, ls.window.v  # the ring: KVDrive's decode attention reads the window itself

    def append(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> None:
        """A decode step's token, ``[B, H, D]`` (or ``[B, H, 1, D]``), into the layer's local window."""
        ls = self.ctx.layers[layer]
        with self.decode_threads():
            self.ctx.kernels.append(ls.window, key, value)
        ls.window.end += 1
        ls.num_tokens += 1

    # ------------------------------------------------------------ prefill

    def finish_prefill(self, layer: int, query: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Index, store and cache one layer after its dense prefill attention ran."""
        keys, values = self.ctx.layers[layer].prefill
        for ob in self.ctx.observers:
            ob.on_prefill_layer(layer, keys, values, query, mask)
        self.valid = planning.valid_from_mask(self.ctx, mask, keys.shape[2])
        if layer == 0:
            # Left padding: a row's sink starts at its first page holding a real token.
            self.ctx.first_page = self.valid.int().argmax(dim=1) // self.cfg.page_size
            self.io.create_sequences()
        # Small ops (the index's eigendecompositions, k-means, the importance scores): split
        # across threads, each waits for its second thread on a busy host (measured: 16x slower).
        with self.decode_threads():
            finish_layer(self.ctx, self.io, layer, query, self.valid)

    def try_restore(self, names: list[str], prefix_pages: int) -> bool:
        """Use the stored prefix pages of every row, if all are there; else store them at prefill."""
        if not self.io.try_restore(names, prefix_pages):
            return False
        for ls in self.ctx.layers:
            ls.num_tokens = prefix_pages * self.cfg.page_size
        self.stats["restored_pages"] += prefix_pages * len(names)
        log.info("reusing %d stored prompt pages of %d sequence(s)", prefix_pages, len(names))
        return True

    # ------------------------------------------------------------ decode

    def decode_threads(self):
        """Context for a decode step's own torch ops (the kernels say which: one intra-op
        thread on the CPU, where the compiled kernels split their own work)."""
        return self.ctx.kernels.threads()

    def decode_attention(self, layer: int, query: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One layer of one decode step: ``[B, Hq, 1, D]`` queries -> ``[B, Hq, 1, D]`` attention output.

        Inference only: no gradient flows through KVDrive's decode (its stages run on
        two threads, and the cache is updated in place).
        """
        sh = self.shape
        q = query[:, :, 0].reshape(query.shape[0], sh.num_kv_heads, sh.group, sh.head_dim)
        out = self.decode_query(layer, q, lambda: planning.valid_from_mask(self.ctx, mask, self.ctx.layers[0].num_tokens))
        return out.reshape(query.shape[0], sh.num_q_heads, 1, sh.head_dim)

    def decode_query(self, layer: int, query: torch.Tensor, valid: Callable[[], torch.Tensor]) -> torch.Tensor:
        """:meth:`decode_attention` for queries grouped by KV head, ``[B, H, G, D]`` in and out;
        ``valid()`` gives the step's real tokens ``[B, t]`` (called at the first layer only)."""
        with torch.no_grad(), self.decode_threads():
            t_start = time.perf_counter()
            if layer == 0:
                self._begin_step(t_start, valid())
            self._advance(layer)
            if self.plan.attends_pages:
                self._size_cache(layer)
            outs = self.pipeline.run(self.plan, layer, query)
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            self.stats["layer_ms"] += (time.perf_counter() - t_start) * 1e3
            if layer == self.shape.num_layers - 1:
                self._end_step()
            return out

    def _begin_step(self, now: float, valid: torch.Tensor) -> None:
        """The step's plan: every layer of a step takes the same tokens, so the mask is read
        once per step and what follows from it is shared by all layers."""
        self._step_start = now
        ls = self.ctx.layers[0]
        self.valid = valid
        num_pages = ls.num_tokens // self.cfg.page_size
        self.plan = planning.build_plan(self.ctx, self.valid, ls.num_tokens, num_pages, self.tuning.micro_batch,
                                        self.plan)

    def _advance(self, layer: int) -> None:
        """Index (and queue for the store) pages completed by the new token; slide the local window."""
        ls, s = self.ctx.layers[layer], self.cfg.page_size
        while ls.num_pages < self.plan.num_pages:
            page = ls.num_pages
            k, v = ls.window.tokens(page * s, (page + 1) * s)
            page_valid = self.valid[:, page * s : (page + 1) * s]
            ls.selector.add_page(k, page_valid)
            for ob in self.ctx.observers:
                ob.on_page(layer, page, k, page_valid)
            ls.num_pages += 1
            self.io.queue_page(layer, page, k, v)
        ls.window.start = max(ls.window.start, self.plan.first_local * s)

    def _size_cache(self, layer: int) -> None:
        ls = self.ctx.layers[layer]
        capacity, per_head = planning.cache_capacity(self.ctx, layer, self.plan.first_local)  # >= sink + k
        if per_head is not None:
            ls.cache.set_head_capacity(per_head)
        ls.cache.grow(capacity)
        ls.cache.reserve_pages(ls.num_pages + 1)

    def _end_step(self) -> None:
        if not self.plan.attends_pages:
            self.io.flush()  # no placement copy went to the host this step to carry the pages
        now = time.perf_counter()
        step_ms = (now - self._step_start) * 1e3
        self.ctx.timeline.mark("step", now, step=self.step, ms=step_ms)
        self.stats["step_ms"] += step_ms
        self.tuning.after_step(self.step, step_ms)
        self.ctx.step += 1
        self.stats["steps"] += 1

    # ------------------------------------------------------------ end

    def index_bytes(self) -> int:
        return sum(ls.selector.index_bytes for ls in self.ctx.layers if ls.selector is not None)

    def cache_bytes(self) -> int:
        """Bytes the device cache reserves on the compute device, all layers (its K and V slots)."""
        return sum(ls.cache.nbytes for ls in self.ctx.layers if ls.cache is not None)

    def kv_bytes(self) -> int:
        """Bytes of the context's K and V in the layers KVDrive serves, all rows (padding included)."""
        sh = self.shape
        per_token = 2 * sh.num_kv_heads * sh.head_dim * sh.dtype.itemsize * self.batch
        return sum(ls.num_tokens for ls in self.ctx.layers) * per_token

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fold_counts()
        self.stats["index_bytes"] = self.index_bytes()
        self.stats["device_cache_bytes"] = self.cache_bytes()
        self.stats["kv_bytes"] = self.kv_bytes()
        self.pipeline.close()
        self.io.close()
        if self.cfg.trace:
            log.info("decode timeline written to %s", self.ctx.timeline.save(self.cfg.trace))
