"""attach(): the handle that makes a transformers model decode through KVDrive (see :mod:`kvdrive_client.hooks`)."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from kvdrive.kernels import compiles_on_cpu, warm_up
from kvdrive_client.architecture import SLIDING, attention_modules, model_shape
from kvdrive_client.config import AttachConfig
from kvdrive_client.decode.prefill import prefill_queries
from kvdrive_client.decode.prefix import on_damage
from kvdrive_client.errors import ChecksumError, StoreError
from kvdrive_client.first_use import KernelNotice
from kvdrive_client.hooks import ATTN_NAME, KVDriveCache
from kvdrive_client.lowrank import fitted_layout
from kvdrive_client.session import Session
from kvdrive_client.store import StoreClient, connect

log = logging.getLogger("kvdrive_client.hooks")


class Handle:
    """What :func:`attach` returns: the model decodes through KVDrive until :meth:`detach`.

    :meth:`stats` reports what decoding did (docs/stats.md); :meth:`new_cache` gives a
    cache for loops that call the model by hand instead of ``generate()``. ``store`` is
    the :class:`~kvdrive_client.store.StoreClient` in use; ``cfg`` the
    :class:`~kvdrive_client.config.AttachConfig`; ``shape`` the model's KVDrive-served
    layers (``num_layers``, ``num_kv_heads``, ``num_q_heads``, ``head_dim``, ``dtype``).
    """

    def __init__(self, model, cfg: AttachConfig, store: StoreClient, owns_store: bool, architecture=None) -> None:
        self.model = model
        self.store = store
        self._owns_store = owns_store
        self.shape, self.kinds = architecture or model_shape(model)
        self.cfg = cfg.for_model(self.shape.num_layers, self.shape.num_kv_heads)
        self.device = torch.device(cfg.device) if cfg.device else next(model.parameters()).device
        self._stats: Counter = Counter()
        self.active: Session | None = None
        self._warned_dense = False
        self._modules = attention_modules(model)
        self._store_counters: dict = {}
        self._attached = False
        self._print: bytes | None = None

    def _attach(self) -> None:
        # Every handle on a model is listed on it: the first one saves the model's own
        # attention implementation, the last one detached restores it, and detaching a
        # handle in any order leaves the others working.
        handles = self.model.__dict__.setdefault(_HANDLES, [])
        if not handles:
            self.model.__dict__[_ORIGINAL_ATTN] = self.model.config._attn_implementation
            self.model.set_attn_implementation(ATTN_NAME)
        handles.append(self)
        for m in self._modules:
            m._kvdrive_handle = self
        original = functools.partial(type(self.model).generate, self.model)

        @functools.wraps(type(self.model).generate)
        def generate(*args: Any, **kwargs: Any):
            if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
                return original(*args, **kwargs)
            _refuse_batch_expansion(self.model, kwargs)
            batch = _batch_size(args, kwargs)
            cache = self.new_cache(batch)
            try:  # a restore that raises (damaged stored windows) closes the cache too
                if self.cfg.reuse and cache.session is not None:
                    self._restore(cache, args, kwargs)
                return original(*args, cache=cache, **kwargs)
            except ChecksumError as exc:
                err = exc if cache.session is None else on_damage(cache.session.io, exc)
                if err is exc:
                    raise
                raise err from exc
            finally:
                cache.close()
                self.active = None

        self._generate = generate
        self.model.generate = generate
        self._attached = True

    def _fingerprint(self) -> bytes:
        if self._print is None:
            h = hashlib.sha256(self.model.config.to_json_string().encode())
            for p in list(self.model.parameters())[:2]:
                h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
            self._print = h.digest()
        return self._print

    def _restore(self, cache: KVDriveCache, args, kwargs) -> None:
        session = cache.session
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        t = ids.shape[1]
        s = self.cfg.page_size
        # Pages end where the prompt does (SessionView.prompt_shift): page 0 starts with `shift`
        # tokens of KVDrive's padding, so a stored page holds other tokens under another
        # shift, and the name says which. At least the last prompt token must run through
        # the model to give the first logits: the last page is not taken from the store.
        shift = session.prompt_shift(t)
        pages = (t - 1 + shift) // s
        # Nor are the pages of the last tokens whose queries the prefill reads (the index's
        # fit, the cache's seed): a reused prompt is indexed and seeded as a fresh one. With
        # the fit to 16 queries of the last page only, not the 512 of a fresh prompt, the
        # chosen pages of SmolLM2 at 7K recalled less of the attention mass.
        restore = min(pages, max(0, (t - prefill_queries(self.cfg) + shift) // s))
        tokens = max(0, pages * s - shift)  # the prompt's tokens on those pages
        names = []
        for row in range(ids.shape[0]):
            h = hashlib.sha256(self._fingerprint())
            h.update(f"{s}:{self.shape.dtype}:shift {shift}".encode())
            h.update(ids[row, :tokens].cpu().numpy().astype("int64").tobytes())
            if mask is not None:
                h.update(mask[row, :tokens].cpu().numpy().astype("int8").tobytes())
            names.append("prefix-" + h.hexdigest()[:40])
        if session.try_restore(names, pages, shift, restore) and session.windows:
            cache.seed_windows(session.windows, session.model_length(0))
            session.windows = []  # the sliding layers hold what they need of them

    def new_cache(self, batch: int) -> KVDriveCache:
        """A cache for one batch; pass it as ``cache=`` to the model and ``close()`` it after."""
        if self.active is not None and not self.active._closed:
            self.active.close()
        if self.shape.num_layers == 0:
            return KVDriveCache(None, self.kinds)
        session = Session(self.cfg, self.shape, self.store, batch, self.device, self._stats)
        session.keep_windows([w for kind, w in self.kinds if kind == SLIDING])
        self.active = session
        return KVDriveCache(session, self.kinds)

    def stats(self) -> dict:
        """This handle's figures so far, summed over every generate() (or cache) it served.

        Counts and byte totals (``hits``, ``misses``, ``bytes_fetched``, ``bytes_from_dram``,
        ``bytes_from_ssd``, ``bytes_put``, ...), milliseconds per stage summed over steps
        (``select_ms``, ``fetch_ms``, ``attention_ms``, ...), ratios (``hit_rate``,
        ``attended_fraction``), the index's size, what the device cache reserves on the
        compute device (``device_cache_bytes``, at most ``kv_bytes``: the context's K and
        V), and under ``store`` the daemon's counters. docs/stats.md lists every key with
        its unit. After :meth:`detach` it returns the final figures.
        """
        if self.active is not None:
            self.active.fold_counts()
        s = dict(self._stats)
        looked = s.get("hits", 0) + s.get("misses", 0)
        s["hit_rate"] = s.get("hits", 0) / looked if looked else None
        bb = self.shape.page_bytes(self.cfg.page_size)
        s["bytes_from_dram"] = s.get("blocks_dram", 0) * bb
        s["bytes_from_ssd"] = s.get("blocks_ssd", 0) * bb
        if s.get("context_tokens"):
            s["attended_fraction"] = s.get("attended_tokens", 0) / s["context_tokens"]
        if self.active is not None:
            s["index_bytes"] = self.active.index_bytes()
            s["device_cache_bytes"] = self.active.cache_bytes()
            s["kv_bytes"] = self.active.kv_bytes()
        # After detach() a store attach() started is gone: its last counters stand.
        s["store"] = self.store.stats().get("counters", {}) if self._attached or not self._owns_store else self._store_counters
        return s

    def detach(self) -> None:
        """Stop decoding through KVDrive: the open cache is closed and, once the model's last
        handle is detached, the model is exactly as before attach() (attention
        implementation, ``generate``, config). A store attach() started is stopped; one
        passed in is left open. Detaching twice does nothing."""
        if not self._attached:
            return
        if self.active is not None:
            self.active.close()
            self.active = None
        handles = self.model.__dict__.get(_HANDLES, [])
        if self in handles:
            handles.remove(self)
        if handles:
            last = handles[-1]
            self.model.generate = last._generate
            for m in self._modules:
                m._kvdrive_handle = last
        else:
            self.model.__dict__.pop("generate", None)
            self.model.__dict__.pop(_HANDLES, None)
            self.model.set_attn_implementation(self.model.__dict__.pop(_ORIGINAL_ATTN))
            for m in self._modules:
                if hasattr(m, "_kvdrive_handle"):
                    del m._kvdrive_handle
        if self._owns_store:
            try:
                self._store_counters = self.store.stats().get("counters", {})
            except StoreError as exc:  # a daemon already gone has no counters to give
                log.info("store counters unavailable at detach: %s", exc)
            self.store.close()
        self._attached = False


_HANDLES = "_kvdrive_handles"
_ORIGINAL_ATTN = "_kvdrive_original_attn"


def _refuse_batch_expansion(model, kwargs: dict) -> None:
    """Beam search and several returned sequences per prompt make transformers expand and
    reorder the batch inside generate(); the KVDrive cache does not follow that yet."""
    gen = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = kwargs.get("num_beams", getattr(gen, "num_beams", 1)) or 1
    returned = kwargs.get("num_return_sequences", getattr(gen, "num_return_sequences", 1)) or 1
    if beams > 1 or returned > 1:
        raise NotImplementedError(
            f"generate(num_beams={beams}, num_return_sequences={returned}) through KVDrive: the cache does not follow "
            f"transformers' batch expansion for beam search or several sequences per prompt; repeat the prompt's rows "
            f"in the batch instead (one row per sequence, sampling), or detach() for beam search"
        )


def _warm_up(handle: Handle) -> None:
    """Compile the CPU kernels now, or load them from the per-machine cache: left to the
    first generate(), the compile (about a minute on a 2-core host) would stall its first
    steps unannounced. Logged at INFO, and told on stderr where logging is not configured
    (first_use.py)."""
    if handle.shape.num_layers and compiles_on_cpu(handle.device, handle.cfg.kernels):
        notice = KernelNotice()  # on stderr where the program set up no logging
        try:
            # The low-rank kernels of the one sketch layout this model's index keeps: the fused
            # layout's alone compile in half the time of every layout's.
            index, head_dim = handle.cfg.index.value, handle.shape.head_dim
            layouts = (fitted_layout(handle.cfg.lowrank_layout(head_dim), head_dim),) if index == "lowrank" else None
            warm_up(dtypes=(handle.shape.dtype,), indexes=(index,), progress=notice, layouts=layouts)
        finally:
            notice.close()


def _batch_size(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None:
        raise ValueError("generate() through KVDrive needs input_ids or inputs_embeds")
    return ids.shape[0]


def attach(model, store: str | StoreClient | None = None, *, dram: str = "256M", **options: Any) -> Handle:
    """Make ``model.generate()`` decode through KVDrive; returns the :class:`Handle`.

    ``model``: a decoder-only transformers 5.x model (an unsupported one raises
    :class:`~kvdrive_client.architecture.UnsupportedModelError` before anything starts).
    ``store``: None (the default) starts a private embedded kvstored with a ``dram``
    DRAM tier, stopped at :meth:`Handle.detach`; a string is the address of a running
    one (``"ipc://PATH"``); a :class:`StoreClient` (``connect()`` for the default daemon)
    is used as is and left open. ``options`` are the
    fields of :class:`AttachConfig` (budget, budget_tokens, page_size, sink_tokens, local_tokens,
    cache_multiplier, cache_bytes, head_multipliers, profile, micro_batch, pipeline, overlap_fetch, trace,
    index, eviction, obs_window, pages_per_cluster, candidate_factor, rank, int8_channels, int2_channels,
    namespace, keep, reuse, device, kernels). Each decode step attends the sink (the first
    ``sink_tokens``), the local window (the last ``local_tokens``) and ``budget`` of the
    pages in between (or ``budget_tokens`` tokens of them); docs/stats.md has the details.
    """
    cfg = replace(AttachConfig(), **options) if options else AttachConfig()
    shape, kinds = model_shape(model)  # refuse unsupported models before starting anything
    sliding = sorted({w for kind, w in kinds if kind == SLIDING})
    if sliding:
        log.info("%d of %d layers attend over a sliding window (%s tokens): their KV stays on the device, the %d "
                 "global layers decode through KVDrive", len(kinds) - shape.num_layers, len(kinds),
                 "/".join(map(str, sliding)), shape.num_layers)
    if cfg.reuse and shape.num_layers == 0:
        raise ValueError("reuse=True: every layer of this model attends over a sliding window, so KVDrive stores "
                         "nothing of a prompt to reuse; attach it with reuse=False")
    if shape.num_layers == 0:
        log.warning("every layer of this model attends over a sliding window: its KV never outgrows the window and "
                    "stays on the device; KVDrive stores nothing for it")
    owns = not isinstance(store, StoreClient)
    client = store if isinstance(store, StoreClient) else connect(store, dram=dram)
    try:
        handle = Handle(model, cfg, client, owns, (shape, kinds))
        _warm_up(handle)
        handle._attach()
    except BaseException:
        if owns:
            client.close()
        raise
    return handle
