"""attach(): KVDrive decoding for transformers models, through the library's own hooks.

- The model's attention implementation becomes ``"kvdrive"``, registered with
  ``transformers.AttentionInterface`` (and the sdpa mask builder with
  ``AttentionMaskInterface``). Prefill runs the model's own dense (sdpa)
  attention; decode steps run KVDrive's sparse attention.
- ``model.generate`` is wrapped on the instance so that every call without an
  explicit ``cache`` gets a fresh :class:`KVDriveCache`.
- :meth:`Handle.detach` restores both; the model is then exactly as before.

Every layer keeps its own attention kind. Global (full-attention) layers decode
through KVDrive; sliding-window layers (Gemma 3's local layers, Qwen2/Qwen3 layers
past ``max_window_layers``, Mistral with ``sliding_window``) keep their window on
the compute device as transformers' own sliding-window cache layer and attend
densely over it: their KV never grows past the window, so it never goes to the store.

A forward pass that carries no KVDriveCache (a plain ``model(**inputs)``) keeps
dense attention; the first such call is logged. A layer's attention runs in the
session of the cache that the layer has just updated, on the same thread, so caches
of several handles on one model (other indexes or budgets, say) can be used in turn.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvdrive_client.config import AttachConfig
from kvdrive_client.errors import KVDriveError, StoreError
from kvdrive_client.session import ModelShape, Session
from kvdrive_client.store import StoreClient, connect

log = logging.getLogger(__name__)

ATTN_NAME = "kvdrive"
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3_text")
GLOBAL, SLIDING = "full_attention", "sliding_attention"


# The session and layer whose cache this thread's forward pass updated last: the
# layer's attention, called right after the update, runs there.
_updated = threading.local()


class UnsupportedModelError(KVDriveError, TypeError):
    """The model lacks something KVDrive needs; the message names it."""


class _Layer(CacheLayerMixin):
    """A global layer: model layer ``model_idx`` is the session's (and the store's) layer ``idx``."""

    is_sliding = False

    def __init__(self, session: Session, idx: int, model_idx: int) -> None:
        super().__init__()
        self.session = session
        self.idx = idx
        self.model_idx = model_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        _updated.pending = (self.session, self.idx, self.model_idx)
        return self.session.update(key_states, value_states, self.idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.session.seq_length(self.idx) + query_length, 0

    def get_seq_length(self) -> int:
        return self.session.seq_length(self.idx)

    def get_max_length(self) -> int:
        return -1


class KVDriveCache(Cache):
    """A transformers Cache whose global layers' KV lives in kvstored, with a device-side
    page cache; sliding-window layers are transformers' own windowed cache layers.

    ``session`` is None for a model without global layers (nothing to store).
    """

    def __init__(self, session: Session | None, kinds: list[tuple[str, int | None]]) -> None:
        layers, idx = [], 0
        for i, (kind, window) in enumerate(kinds):
            if kind == SLIDING:
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
            else:
                layers.append(_Layer(session, idx, i))
                idx += 1
        super().__init__(layers=layers)
        self.session = session

    def close(self) -> None:
        if self.session is None:
            return
        self.session.close()
        pending = getattr(_updated, "pending", None)
        if pending is not None and pending[0] is self.session:
            _updated.pending = None  # a closed session's buffers are not kept alive here


def _kvdrive_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    handle: Handle | None = getattr(module, "_kvdrive_handle", None)
    pending = getattr(_updated, "pending", None) if handle is not None else None
    if pending is None or pending[2] != module.layer_idx:
        if handle is not None and not handle._warned_dense and handle.kinds[module.layer_idx][0] == GLOBAL:
            log.info("forward pass without a KVDriveCache: dense sdpa attention")
            handle._warned_dense = True
        # A sliding-window layer attends densely over the window its own cache layer keeps.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _updated.pending = None
    session, layer = pending[0], pending[1]
    if session.prefill_pending(layer):
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        session.finish_prefill(layer, query, attention_mask)
        return out
    out = session.decode_attention(layer, query, attention_mask)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, _kvdrive_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _model_shape(model) -> tuple[ModelShape, list[tuple[str, int | None]]]:
    """The shape of the model's global layers (the ones KVDrive stores), and every layer's
    attention kind with its window (None for a global layer)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no .config; attach() takes a transformers model")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; KVDrive supports decoder-only transformers with rotary "
            f"attention whose layers attend globally or over a sliding window: {', '.join(SUPPORTED)}"
        )
    missing = [f for f in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads") if getattr(config, f, None) is None]
    if missing:
        raise UnsupportedModelError(f"model config lacks {', '.join(missing)}")
    kinds = layer_kinds(config)
    layers = _attention_modules(model)
    if len(layers) != config.num_hidden_layers:
        raise UnsupportedModelError(f"found {len(layers)} attention modules with layer_idx, config says {config.num_hidden_layers}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"this {model_type} model caps attention logits (attn_logit_softcapping={config.attn_logit_softcapping}); "
            f"KVDrive's sparse attention computes plain softmax attention"
        )
    global_modules = [m for m in layers if kinds[m.layer_idx][0] == GLOBAL]
    scalings = {float(m.scaling) for m in global_modules}
    if len(scalings) > 1:
        raise UnsupportedModelError(f"global layers scale attention differently ({sorted(scalings)}); KVDrive takes one scale")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UnsupportedModelError(f"parameter dtype {dtype} is not float16, bfloat16 or float32")
    scaling = scalings.pop() if scalings else head_dim**-0.5
    shape = ModelShape(len(global_modules), config.num_key_value_heads, config.num_attention_heads, head_dim, dtype, scaling)
    return shape, kinds


def layer_kinds(config) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per layer, as transformers' own caches read the config: ``layer_types``
    where the config has it (hybrid models mix both kinds), else a ``sliding_window`` on every
    layer. Kinds other than global and sliding-window attention are refused by name."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    # Named kinds are checked before transformers reads them: it reads each kind's own fields.
    _refuse_other_kinds(config, getattr(text, "layer_types", None) or [])
    types, kwargs = get_layer_types_and_kwargs(text)
    _refuse_other_kinds(config, types)
    if len(types) != config.num_hidden_layers:
        raise UnsupportedModelError(f"config names {len(types)} layer types for {config.num_hidden_layers} layers")
    kinds = []
    for i, (kind, kw) in enumerate(zip(types, kwargs)):
        window = kw.get("sliding_window") if kind == SLIDING else None
        if kind == SLIDING and not (isinstance(window, int) and window > 0):
            raise UnsupportedModelError(f"layer {i} is a sliding-window layer without a window size ({window!r})")
        kinds.append((kind, window))
    return kinds


def _refuse_other_kinds(config, types) -> None:
    other = sorted({t for t in types if t not in (GLOBAL, SLIDING)})
    if other:
        raise UnsupportedModelError(
            f"layer kind(s) {', '.join(other)} of this {config.model_type} model are not supported; KVDrive decodes "
            f"global attention through the store and keeps sliding-window layers on the device"
        )


def _attention_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "scaling")]


class Handle:
    """What attach() returns: stats(), detach(), and new_cache() for hand-driven loops."""

    def __init__(self, model, cfg: AttachConfig, store: StoreClient, owns_store: bool) -> None:
        self.model = model
        self.store = store
        self._owns_store = owns_store
        self.shape, self.kinds = _model_shape(model)
        self.cfg = cfg.for_model(self.shape.num_layers, self.shape.num_kv_heads)
        self.device = torch.device(cfg.device) if cfg.device else next(model.parameters()).device
        self._stats: Counter = Counter()
        self.active: Session | None = None
        self._warned_dense = False
        self._modules = _attention_modules(model)
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
            if self.cfg.reuse and cache.session is not None:
                self._restore(cache.session, args, kwargs)
            try:
                return original(*args, cache=cache, **kwargs)
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

    def _restore(self, session: Session, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        t = ids.shape[1]
        s = self.cfg.page_size
        # At least the last prompt token must run through the model to give the first logits.
        pages = (t - 1) // s
        names = []
        for row in range(ids.shape[0]):
            h = hashlib.sha256(self._fingerprint())
            h.update(f"{s}:{self.shape.dtype}".encode())
            h.update(ids[row, : pages * s].cpu().numpy().astype("int64").tobytes())
            if mask is not None:
                h.update(mask[row, : pages * s].cpu().numpy().astype("int8").tobytes())
            names.append("prefix-" + h.hexdigest()[:40])
        session.try_restore(names, pages)

    def new_cache(self, batch: int) -> KVDriveCache:
        """A cache for one batch; pass it as ``cache=`` to the model and ``close()`` it after."""
        if self.active is not None and not self.active._closed:
            self.active.close()
        if self.shape.num_layers == 0:
            return KVDriveCache(None, self.kinds)
        session = Session(self.cfg, self.shape, self.store, batch, self.device, self._stats)
        self.active = session
        return KVDriveCache(session, self.kinds)

    def stats(self) -> dict:
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
        # After detach() a store attach() started is gone: its last counters stand.
        s["store"] = self.store.stats().get("counters", {}) if self._attached or not self._owns_store else self._store_counters
        return s

    def detach(self) -> None:
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


def _batch_size(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None:
        raise ValueError("generate() through KVDrive needs input_ids or inputs_embeds")
    return ids.shape[0]


def attach(model, store: str | StoreClient | None = None, *, dram: str = "256M", **options: Any) -> Handle:
    """Make ``model.generate()`` decode through KVDrive.

    ``store``: None starts a private embedded kvstored (``dram`` sized); a string is
    the address of a running one; a StoreClient is used as is. ``options`` are the
    fields of :class:`AttachConfig` (budget, budget_tokens, page_size, sink_tokens, local_tokens,
    window, cache_bytes, windows, profile, micro_batch, pipeline, overlap_fetch, trace,
    index, eviction, obs_window, pages_per_cluster, candidate_factor, rank, namespace,
    keep, reuse, device).
    """
    cfg = replace(AttachConfig(), **options) if options else AttachConfig()
    shape, kinds = _model_shape(model)  # refuse unsupported models before starting anything
    sliding = sorted({w for kind, w in kinds if kind == SLIDING})
    if sliding:
        log.info("%d of %d layers attend over a sliding window (%s tokens): their KV stays on the device, the %d "
                 "global layers decode through KVDrive", len(kinds) - shape.num_layers, len(kinds),
                 "/".join(map(str, sliding)), shape.num_layers)
    if shape.num_layers == 0:
        log.warning("every layer of this model attends over a sliding window: its KV never outgrows the window and "
                    "stays on the device; KVDrive stores nothing for it")
    owns = not isinstance(store, StoreClient)
    client = store if isinstance(store, StoreClient) else connect(store, dram=dram)
    try:
        handle = Handle(model, cfg, client, owns)
        handle._attach()
    except BaseException:
        if owns:
            client.close()
        raise
    return handle
