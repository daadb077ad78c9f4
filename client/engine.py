"""The lower-level API, for inference engines that are not transformers.

The engine runs its own model and its own dense prefill attention; KVDrive takes
each layer's keys and values (post-RoPE) and, per decode step and layer, returns
the attention output for the step's query::

    from kvdrive_client import connect
    from kvdrive_client.engine import ModelShape, SparseKV

    store = connect()                              # or connect(None): a private daemon
    kv = SparseKV(store, ModelShape(32, 8, 32, 128, torch.float16), batch=1, budget=0.0625)
    for layer in range(32):                      # prefill
        kv.prefill(layer, query, keys, values)   # [B, Hq, T, D], [B, H, T, D], [B, H, T, D]
    for step in ...:                              # decode, one token per step
        for layer in range(32):
            out = kv.decode(layer, q, k, v)      # q [B, Hq, D], k/v [B, H, D] -> [B, Hq, D]
    kv.close()

``valid`` (``[B, T]`` bool) marks real tokens of left-padded rows at prefill. Every
layer's prefill comes before the first decode step, and each step calls ``decode``
for layers 0, 1, ... in order (the first layer of a step plans it for all).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from kvdrive_client.config import AttachConfig
from kvdrive_client.session import ModelShape, Session
from kvdrive_client.store import StoreClient

__all__ = ["ModelShape", "SparseKV"]

VALID_RESERVE = 256  # decoded tokens' room in the token mask, added at a time


class SparseKV:
    """KVDrive for one batch of ``batch`` sequences, from prefill to the end of decode.

    ``store``: a :class:`~kvdrive_client.store.StoreClient` (``connect()``), left open
    at :meth:`close`. ``shape``: the model's, ``ModelShape(num_layers, num_kv_heads,
    num_q_heads, head_dim, dtype[, scaling])`` (scaling default ``head_dim ** -0.5``;
    dtype float16, bfloat16 or float32, as the K/V handed in). ``device``: where K/V,
    the index and the device cache live. ``options``: as
    :class:`~kvdrive_client.config.AttachConfig`'s (``budget``, ``page_size``, ...).
    The batch's store sequences are deleted at :meth:`close` unless ``keep=True``.
    """

    def __init__(self, store: StoreClient, shape: ModelShape, batch: int, device: str | torch.device = "cpu",
                 **options) -> None:
        if shape.num_q_heads % shape.num_kv_heads:
            raise ValueError(f"num_q_heads ({shape.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({shape.num_kv_heads})")
        cfg = (replace(AttachConfig(), **options) if options else AttachConfig()).for_model(shape.num_layers,
                                                                                            shape.num_kv_heads)
        self._stats: Counter = Counter()
        self.session = Session(cfg, shape, store, batch, torch.device(device), self._stats)

    @property
    def stats(self) -> Counter:
        """The session's figures so far (those counted on the device copied over first); the
        keys are those of ``Handle.stats()`` that the session counts (docs/stats.md)."""
        return self.session.fold_counts()

    def prefill(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
        """Store, index and cache one layer's prompt K/V (the engine computed its attention).

        ``query`` ``[B, Hq, T, D]`` (the prompt's queries: the index is fitted to them and
        page importance read from the last ones), ``keys``/``values`` ``[B, H, T, D]``
        post-RoPE, ``valid`` ``[B, T]`` bool or None (every token real).
        """
        self.session.update(keys, values, layer)
        mask = None if valid is None else valid[:, None, None, :]
        self.session.finish_prefill(layer, query, mask)

    def decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Append one token's K/V and attend: ``query`` ``[B, Hq, D]``, ``key``/``value``
        ``[B, H, D]`` -> ``[B, Hq, D]``, exact softmax attention over the sink, the pages
        selected for this step and the local window (the new token included)."""
        session, sh = self.session, self.session.shape
        with session.decode_threads():
            session.append(key, value, layer)

            def valid() -> torch.Tensor:  # the prompt's real tokens, then every decoded one
                have, t = session.valid, session.seq_length(layer)
                if have.shape[1] >= t:
                    return have
                # Room for the tokens of many steps at once: the mask grows once in a while, not every step.
                more = max(t - have.shape[1], VALID_RESERVE)
                return torch.cat([have, have.new_ones(have.shape[0], more)], dim=1)

            b = query.shape[0]
            out = session.decode_query(layer, query.reshape(b, sh.num_kv_heads, sh.group, sh.head_dim), valid)
        return out.reshape(b, sh.num_q_heads, sh.head_dim)

    def close(self) -> None:
        """Write the pages completed while decoding, free the buffers, delete the sequences
        (unless ``keep``); :attr:`stats` keeps the final figures."""
        self.session.close()
