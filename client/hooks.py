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

import copy
import logging
import threading
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvdrive_client.architecture import GLOBAL, SLIDING
from kvdrive_client.session import Session

if TYPE_CHECKING:
    from kvdrive_client.handle import Handle

log = logging.getLogger(__name__)

ATTN_NAME = "kvdrive"


# The session and layer whose cache this thread's forward pass updated last: the
# layer's attention, called right after the update, runs there.
_updated = threading.local()


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
        return self.session.model_length(self.idx) + query_length, 0

    def get_seq_length(self) -> int:
        return self.session.model_length(self.idx)

    def get_max_length(self) -> int:
        return -1


class _SlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer (transformers' own), the session's ``j``-th: its prefill KV goes to
    the session for a stored prompt's windows, and a reused prompt seeds it with its window."""

    def __init__(self, session: Session | None, j: int, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.session = session
        self.j = j

    def update(self, key_states, value_states, *args, **kwargs):
        if self.session is not None and self.cumulative_length == 0:
            self.session.capture_window(self.j, key_states, value_states)
        return super().update(key_states, value_states, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "_SlidingLayer":
        """A copy of the window, linked to no session: a copy is another cache's layer (the
        fidelity bench replays a prefill's into each session it runs)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, None if name == "session" else copy.deepcopy(value, memo))
        return twin

    def seed(self, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
        """Start as after ``seen`` tokens, ``keys`` / ``values`` ``[B, H, >= n, D]`` holding the last ``n`` of them."""
        n = min(self.sliding_window - 1, seen)
        keys, values = keys[:, :, keys.shape[2] - n :], values[:, :, values.shape[2] - n :]
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys.contiguous(), values.contiguous()
        self.cumulative_length = seen


class KVDriveCache(Cache):
    """A transformers Cache whose global layers' KV lives in kvstored, with a device-side
    page cache; sliding-window layers are transformers' own windowed cache layers.

    ``session`` is None for a model without global layers (nothing to store).
    """

    def __init__(self, session: Session | None, kinds: list[tuple[str, int | None]]) -> None:
        layers, idx, j = [], 0, 0
        for i, (kind, window) in enumerate(kinds):
            if kind == SLIDING:
                layers.append(_SlidingLayer(session, j, window))
                j += 1
            else:
                layers.append(_Layer(session, idx, i))
                idx += 1
        super().__init__(layers=layers)
        self.session = session

    def seed_windows(self, windows: list[tuple[torch.Tensor, torch.Tensor]], seen: int) -> None:
        """A reused prompt's sliding-window layers start with their stored windows (``seen`` tokens in)."""
        sliding = [layer for layer in self.layers if isinstance(layer, _SlidingLayer)]
        for layer, (k, v) in zip(sliding, windows, strict=True):
            layer.seed(k, v, seen)

    def close(self) -> None:
        if self.session is None:
            return
        self.session.close()
        pending = getattr(_updated, "pending", None)
        if pending is not None and pending[0] is self.session:
            _updated.pending = None  # a closed session's buffers are not kept alive here


def _kvdrive_attention(module, query, key, value, attention_mask, **kwargs):
    handle: Handle | None = getattr(module, "_kvdrive_handle", None)
    pending = getattr(_updated, "pending", None) if handle is not None else None
    if pending is None or pending[2] != module.layer_idx:
        if handle is not None and not handle._warned_dense and handle.kinds[module.layer_idx][0] == GLOBAL:
            log.info("forward pass without a KVDriveCache: dense sdpa attention")
            handle._warned_dense = True
        # A sliding-window layer attends densely over the window its own cache layer keeps.
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _updated.pending = None
    session, layer = pending[0], pending[1]
    if session.prefill_pending(layer):
        out = _prefill_attention(module, query, key, value, attention_mask, **kwargs)
        session.finish_prefill(layer, query, attention_mask)
        return out
    out = session.decode_attention(layer, query, attention_mask)
    return out.transpose(1, 2).contiguous(), None


def _prefill_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's dense prefill attention; a left-padded batch's row by row over each row's
    own tokens, the call it makes alone (its padding's outputs are zeros, never read).

    A row's keys and queries then come out of every KVDrive layer as they do alone, not
    merely close: the low-rank index fitted to them (an eigendecomposition) can turn the
    last bits of a batched softmax into another choice of pages."""
    b, _, t, _ = query.shape
    if b == 1 or attention_mask is None or attention_mask.dim() != 4 or key.shape[2] != t:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    row = attention_mask[:, 0, -1]
    valid = row if row.dtype == torch.bool else row == 0
    pad = t - valid.sum(dim=1)
    left_padded = torch.arange(t, device=valid.device)[None, :] >= pad[:, None]
    pads = pad.tolist()
    if not any(pads) or not torch.equal(valid, left_padded):  # no padding, or not only before the prompt
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = query.new_zeros(b, t, query.shape[1], value.shape[3])
    for r, p in enumerate(pads):
        if p < t:
            o, _ = sdpa_attention_forward(module, query[r : r + 1, :, p:], key[r : r + 1, :, p:],
                                          value[r : r + 1, :, p:], None, **kwargs)
            out[r, p:] = o[0]
    return out, None


AttentionInterface.register(ATTN_NAME, _kvdrive_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
