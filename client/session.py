"""One generation's KV state: prefill into the store, sparse decode out of it.

A :class:`Session` covers a batch of sequences (left-padded to one length) from
prefill to the end of decode. Pages are cut from the end of the prompt: KVDrive puts
``shift`` padding tokens before it, so that its length is a whole number of pages.
A row's pages then hold the same tokens of its prompt whatever the padding before
it, batched or alone, and every row completes a page on the same decode steps.

It orchestrates the stages of :mod:`kvdrive_client.decode`; per layer it keeps, on the compute device, the local
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
from kvdrive_client.decode import prefix
from kvdrive_client.decode.fetch import StoreIO
from kvdrive_client.decode.pipeline import Pipeline
from kvdrive_client.decode.prefill import finish_layer
from kvdrive_client.decode.state import Context, LayerState, ModelShape, Observer, StepPlan
from kvdrive_client.decode.tuning import START_MULTIPLIER, Tuning
from kvdrive_client.decode.view import SessionView
from kvdrive_client.decode.windows import Windows
from kvdrive_client.errors import ChecksumError, StoreError
from kvdrive_client.store import StoreClient
from kvdrive_client.timeline import Timeline

__all__ = ["ModelShape", "Observer", "Session"]

log = logging.getLogger(__name__)


class Session(SessionView):
    """One batch's KV state from prefill to the end of decode (see the module)."""

    def __init__(self, cfg: AttachConfig, shape: ModelShape, store: StoreClient, batch: int, device: torch.device,
                 stats: Counter) -> None:
        kernels = for_device(device, cfg.kernels)
        self.ctx = Context(cfg, shape, batch, device, kernels, stats, Timeline(enabled=cfg.trace is not None),
                           [LayerState() for _ in range(shape.num_layers)],
                           multiplier=(cfg.cache_multiplier if cfg.cache_multiplier is not None
                                       else START_MULTIPLIER))
        self.io = StoreIO(self.ctx, store)
        self.windows: list[tuple[torch.Tensor, torch.Tensor]] = []  # a reused prompt's, to seed them with
        self.pipeline = Pipeline(self.ctx, self.io)
        self.tuning = Tuning(self.ctx)
        self.plan: StepPlan | None = None
        self.valid: torch.Tensor | None = None  # [B, >= tokens]: which tokens are real (not padding, not the shift)
        self.shift = 0  # padding tokens before the model's: the prompt ends on a page boundary
        self._step_start = 0.0
        self._closed = False
        if cfg.overlap_fetch and not kernels.attends_in_parts:
            log.info("overlap_fetch: the %s kernels attend in one pass, after each fetch lands", kernels.name)

    def prefill_pending(self, layer: int) -> bool:
        """Whether a layer holds prefill K/V waiting for :meth:`finish_prefill`."""
        return self.ctx.layers[layer].prefill is not None

    # ------------------------------------------------------------ transformers Cache hooks

    def seq_length(self, layer: int = 0) -> int:
        """Tokens in a layer's context, the ``shift`` included: positions of keys, pages and ``valid``."""
        return self.ctx.layers[layer].num_tokens

    def model_length(self, layer: int = 0) -> int:
        """The model's tokens in a layer (the ``shift`` left out): what transformers counts."""
        n = self.ctx.layers[layer].num_tokens
        return n - self.shift if n else 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ls = self.ctx.layers[layer]
        q_len = key.shape[2]
        if ls.selector is None:
            if ls.prefill is not None:
                raise RuntimeError("KVDrive prefill runs once per session")
            if self.io.restored:  # the stored prefix holds the shift already
                past_k, past_v = prefix.load_prefix(self.io, layer)
                keys, values = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
                key, value = keys[:, :, self.shift :], values[:, :, self.shift :]
            else:
                self.shift = planning.prompt_shift(q_len, self.cfg.page_size)
                keys, values = planning.pad_front(key, self.shift), planning.pad_front(value, self.shift)
            ls.prefill = (keys, values)
            ls.num_tokens = keys.shape[2]
            self.stats["prefill_tokens"] += q_len * (layer == 0)
            return key, value
        if q_len != 1:
            raise ValueError(
                f"KVDrive decodes one token per step after prefill (got {q_len} tokens at layer {layer}); "
                "start a new generate() for a new prompt"
            )
        if layer == 0 and self.io.windows is not None:
            self.io.windows.put()  # the prefill has run every sliding layer
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
        for ob in self.ctx.observers:  # what the model handed over, without the shift
            ob.on_prefill_layer(layer, keys[:, :, self.shift :], values[:, :, self.shift :], query, mask)
        self.valid = planning.shifted(planning.valid_from_mask(self.ctx, mask, keys.shape[2] - self.shift), self.shift)
        if layer == 0:
            # Left padding: a row's sink starts at its first page holding a real token.
            first = self.valid.int().argmax(dim=1) // self.cfg.page_size
            self.ctx.first_page, self.ctx.first_pages = first, first.tolist()
            self.io.create_sequences()
        # Small ops (the index's eigendecompositions, k-means, the importance scores): split
        # across threads, each waits for its second thread on a busy host (measured: 16x slower).
        with self.decode_threads():
            finish_layer(self.ctx, self.io, layer, query, self.valid)

    def try_restore(self, names: list[str], prefix_pages: int, shift: int = 0, restore_pages: int | None = None) -> bool:
        """Use the stored prefix pages of every row, if all are there; else store them at prefill.

        ``shift``: :meth:`prompt_shift` of the prompt; the stored pages begin with it, so
        a prefix is only the same one for a prompt of the same shift (the names say so).
        ``restore_pages`` (default: all ``prefix_pages``): how many of them to load; the model
        runs over the prompt's tokens after them."""
        self.shift = shift
        restore = prefix_pages if restore_pages is None else restore_pages
        if not prefix.open_prefix(self.io, names, prefix_pages, restore):
            return False
        if self.io.windows is not None:
            try:
                self.windows = self.io.windows.load()
            except ChecksumError as exc:
                raise prefix.drop_prefix(self.io, exc) from exc
        restore = self.io.base_pages
        for ls in self.ctx.layers:
            ls.num_tokens = restore * self.cfg.page_size
        self.stats["restored_pages"] += restore * len(names)
        log.info("reusing %d of %d stored prompt pages of %d sequence(s)", restore, prefix_pages, len(names))
        return True

    def keep_windows(self, sizes: list[int]) -> None:
        """With reuse: the model's sliding-window layers (their windows' sizes) have their windows
        kept beside a stored prompt's pages, and loaded with a reused one's (:mod:`.decode.windows`)."""
        if sizes and self.cfg.reuse:
            self.io.windows = Windows(self.io, sizes)

    def capture_window(self, j: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Sliding-window layer ``j``'s prefill K and V, for the prompt's stored windows (:mod:`.decode.windows`)."""
        if self.io.windows is not None and not self.io.restored:
            self.io.windows.capture(j, keys, values, self.shift)

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
        out = self.decode_query(layer, q, lambda: planning.shifted(
            planning.valid_from_mask(self.ctx, mask, self.model_length(0)), self.shift))
        return out.reshape(query.shape[0], sh.num_q_heads, 1, sh.head_dim)

    def decode_query(self, layer: int, query: torch.Tensor, valid: Callable[[], torch.Tensor]) -> torch.Tensor:
        """:meth:`decode_attention` for queries grouped by KV head, ``[B, H, G, D]`` in and out;
        ``valid()`` gives the step's real tokens ``[B, t]``, the ``shift`` included (called at the first
        layer only)."""
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fold_counts()
        self.stats["index_bytes"] = self.index_bytes()
        self.stats["device_cache_bytes"] = self.cache_bytes()
        self.stats["kv_bytes"] = self.kv_bytes()
        self.pipeline.close()
        if self.io.windows is not None:
            try:
                self.io.windows.put()  # a generate() that ended at its prefill
            except StoreError as exc:
                log.warning("this prompt's sliding-window layers' windows were not stored: %s", exc)
        self.io.close()
        if self.cfg.trace:
            log.info("decode timeline written to %s", self.ctx.timeline.save(self.cfg.trace))

