"""What more than one of KVDrive's benchmarks and tools use: a prefill captured once and
replayed into fresh sessions, teacher-forced decoding and its comparison with dense
attention, the selection-trace observer, and sessions that decode side by side.

Side by side: every decode step is taken by each session in turn, the order reversed
every other step, so that a slow spell of a shared machine falls on all of them alike
and their times compare.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from kvdrive_client.cache_sim import Trace
from kvdrive_client.selectors import IndexKind
from kvdrive_client.session import Observer, Session

CAPTURE_ATTN = "kvdrive-capture"  # the attention implementation a chunked prefill registers to see the queries


class InputError(ValueError):
    """The options or the inputs cannot give the run asked for; the message says what to change."""


# ---------------------------------------------------------------- prefill once, replay per run


class PrefillSnapshot:
    """What KVDrive's prefill hook received per global layer (keys, values, queries, mask), and
    the sliding-window layers' own cache layers as the prefill left them (hybrid models)."""

    def __init__(self, layers: list[tuple], sliding: dict | None = None) -> None:
        self.layers = layers
        self.sliding = sliding or {}

    @classmethod
    def capture(cls, model, store, ids: torch.Tensor, chunk: int | None = None) -> "PrefillSnapshot":
        """One prefill through KVDrive's own hook; with ``chunk``, a context longer than that
        runs densely in chunks of ``chunk`` tokens instead (see :meth:`capture_chunked`)."""
        if chunk is not None and ids.shape[1] > chunk:
            return cls.capture_chunked(model, ids, chunk)
        from kvdrive_client import attach  # noqa: PLC0415

        handle = attach(model, store, index=IndexKind.MEAN_KEY)
        try:
            cache = handle.new_cache(ids.shape[0])
            session = cache.session
            layers: list[tuple | None] = [None] * session.shape.num_layers

            class Keep(Observer):
                def on_prefill_layer(self, layer, keys, values, query, mask):
                    layers[layer] = (keys, values, query, mask)

            session.add_observer(Keep())
            model(input_ids=ids, cache=cache, logits_to_keep=1)
            sliding = {i: copy.deepcopy(layer) for i, layer in enumerate(cache.layers) if layer.is_sliding}
            cache.close()
        finally:
            handle.detach()
        assert all(x is not None for x in layers), "the prefill skipped a layer"
        return cls(layers, sliding)

    @classmethod
    def capture_chunked(cls, model, ids: torch.Tensor, chunk: int) -> "PrefillSnapshot":
        """A dense prefill of one unpadded row in chunks of ``chunk`` tokens through a plain
        DynamicCache, the global layers' queries kept as they pass (see :mod:`kvdrive.tools.bench_fidelity`)."""
        from transformers import AttentionInterface, DynamicCache  # noqa: PLC0415
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

        from kvdrive_client.architecture import GLOBAL, layer_kinds  # noqa: PLC0415

        if ids.shape[0] != 1:
            raise ValueError("a chunked prefill takes one row")
        kinds = layer_kinds(model.config)
        queries: dict[int, list[torch.Tensor]] = {i: [] for i, (kind, _) in enumerate(kinds) if kind == GLOBAL}

        def capturing(module, query, key, value, attention_mask, **kwargs):
            if module.layer_idx in queries:
                queries[module.layer_idx].append(query)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(CAPTURE_ATTN, capturing)
        AttentionMaskInterface.register(CAPTURE_ATTN, sdpa_mask)
        before = model.config._attn_implementation
        model.set_attn_implementation(CAPTURE_ATTN)
        try:
            cache = DynamicCache(config=model.config)
            for lo in range(0, ids.shape[1], chunk):
                model(input_ids=ids[:, lo : lo + chunk], cache=cache, logits_to_keep=1)
        finally:
            model.set_attn_implementation(before)
        layers = [(cache.layers[i].keys, cache.layers[i].values, torch.cat(q, dim=2), None) for i, q in queries.items()]
        sliding = {i: cache.layers[i] for i, layer in enumerate(cache.layers) if layer.is_sliding}
        return cls(layers, sliding)

    def replay(self, cache) -> None:
        """Prefill a fresh KVDriveCache as the model's forward pass would."""
        session: Session = cache.session
        for i, layer in enumerate(cache.layers):
            if layer.is_sliding:
                cache.layers[i] = copy.deepcopy(self.sliding[i])
                continue
            keys, values, query, mask = self.layers[layer.idx]
            cache.update(keys, values, i)
            session.finish_prefill(layer.idx, query, mask)

    def dense_cache(self, config):
        from transformers import DynamicCache  # noqa: PLC0415

        cache = DynamicCache(config=config)
        layers = iter(self.layers)
        for i, layer in enumerate(cache.layers):
            if layer.is_sliding:
                cache.layers[i] = copy.deepcopy(self.sliding[i])
            else:
                keys, values, _, _ = next(layers)
                cache.update(keys, values, i)
        return cache



def teacher_force(model, cache, fed: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, V]`` after each of the ``fed`` tokens ``[1, T]``, one decode step each."""
    out = []
    for i in range(fed.shape[1]):
        out.append(model(input_ids=fed[:, i : i + 1], cache=cache).logits[0, -1].float())
    return torch.stack(out)


def compare(logits: torch.Tensor, dense: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """(dloss, kl, top1) of ``logits`` against ``dense``, both ``[T, V]``; ``targets`` ``[T]``."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    ld = torch.log_softmax(dense.double(), dim=-1)
    nll = -lp.gather(1, targets[:, None])
    nll_dense = -ld.gather(1, targets[:, None])
    kl = (ld.exp() * (ld - lp)).sum(dim=-1)
    top1 = (logits.argmax(dim=-1) == dense.argmax(dim=-1)).double()
    return float((nll - nll_dense).mean()), float(kl.mean()), float(top1.mean())



# ---------------------------------------------------------------- observers


class TraceObserver(Observer):
    """The chosen pages and the selector's scores of every page, per step, layer and KV head."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.seeded: dict[int, np.ndarray] = {}

    def on_seed(self, layer, ranked):
        self.seeded[layer] = ranked.cpu().numpy()

    def on_select(self, layer, step, query, chosen, selectable, selector):
        scores = selector.scores(query).float()
        self.steps[(step, layer)] = (chosen.cpu().numpy(), scores.cpu().numpy())

    def trace(self) -> Trace:
        """Streams are (batch row, layer, KV head); steps and pages padded with -1 / -inf."""
        keys = sorted(self.steps)
        steps = sorted({s for s, _ in keys})
        layers = sorted({l for _, l in keys})
        b, h, _ = self.steps[keys[0]][0].shape
        k = max(c.shape[2] for c, _ in self.steps.values())
        p = max(sc.shape[2] for _, sc in self.steps.values())
        selected = np.full((b, len(layers), h, len(steps), k), -1, dtype=np.int64)
        scores = np.full((b, len(layers), h, len(steps), p), -np.inf, dtype=np.float32)
        for (step, layer), (chosen, sc) in self.steps.items():
            t, li = steps.index(step), layers.index(layer)
            selected[:, li, :, t, : chosen.shape[2]] = chosen
            scores[:, li, :, t, : sc.shape[2]] = sc
        n = b * len(layers) * h
        seeded = None
        if all(layer in self.seeded for layer in layers):
            width = max(self.seeded[layer].shape[2] for layer in layers)
            seeded = np.full((b, len(layers), h, width), -1, dtype=np.int64)
            for li, layer in enumerate(layers):
                ranked = self.seeded[layer]
                seeded[:, li, :, : ranked.shape[2]] = ranked
            seeded = seeded.reshape(n, width)
        return Trace(selected.reshape(n, len(steps), k), scores.reshape(n, len(steps), p), seeded)



# ---------------------------------------------------------------- side by side


def turn_order(n: int, step: int) -> range:
    """The order in which ``n`` side-by-side sessions take decode step ``step``: reversed every other step."""
    return range(n) if step % 2 == 0 else range(n - 1, -1, -1)


def in_turns(sessions: int, steps: int, first_timed: int, take_step, before_step=None) -> list[float]:
    """Run ``take_step(session, step)`` for every step in every session, a step each in turn
    (the order reversed every other step): seconds per session over steps from
    ``first_timed`` on, so a slow spell of the machine falls on all of them alike.
    ``before_step(step)``, untimed, prepares what all sessions take at that step."""
    seconds = [0.0] * sessions
    with torch.no_grad():
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            for j in turn_order(sessions, i):
                t0 = time.perf_counter()
                take_step(j, i)
                if i >= first_timed:
                    seconds[j] += time.perf_counter() - t0
    return seconds

