"""A layer's decode work on the device, between its host interactions, compiles as one graph.

With the Triton kernels a layer's decode step meets the host once: the placement's copy,
which carries the miss list. The device work before it (the new token into the local
window, a completed page into the index, scoring, the page choice, the placement) and
after it (the fetched pages into the cache, attention) are the step's two segments; on a
GPU each can be captured once in a CUDA graph and replayed. Here, on the CPU, each
segment's kernel calls, as a real decode issues them and with its arguments, run under
``torch.compile(fullgraph=True, dynamic=False)``: a graph break (a host synchronisation,
a data-dependent shape, an untraceable launch) fails the compile. The compiled segment
must also compute what the uncompiled one does. Batch 1 and 4 through the engine API,
and a Gemma 3-like hybrid model's global layers through ``attach``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")
try:
    from kvdrive.kernels import triton_kernels as tk
    from kvdrive.kernels import triton_ops
    NOT_INTERPRETED = None if tk.INTERPRETED else "the Triton kernels run here only under Triton's interpreter"
except ImportError as e:
    NOT_INTERPRETED = f"the Triton kernels do not load: {e}"
pytestmark = pytest.mark.skipif(NOT_INTERPRETED is not None, reason=NOT_INTERPRETED or "")

from kvdrive_client import attach  # noqa: E402
from kvdrive_client.engine import ModelShape, SparseKV  # noqa: E402

from test_attach_tiny import generate, left_padded  # noqa: E402
from test_hybrid import F, S, hybrid  # noqa: E402

# The kernel-set calls that do device work, and those after the host has the miss list.
DEVICE_CALLS = ("append", "lowrank_add_page", "lowrank_choose", "place", "land", "attend_window")
AFTER_SYNC = ("land", "attend_window")
# "eager": Dynamo's trace alone (what a graph break fails); aot_eager would also functionalise it, at twice the time.
BACKEND = "eager"


class Recorder:
    """Records the device-work calls of every Triton kernel set, with a copy of their arguments as made."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.kernels = None
        self.methods = {name: getattr(tk.TritonKernels, name) for name in DEVICE_CALLS}
        for name, method in self.methods.items():
            monkeypatch.setattr(tk.TritonKernels, name, self._recorded(name, method))

    def _recorded(self, name, method):
        def call(kernels, *args, **kwargs):
            self.kernels = kernels
            self.calls.append((name, *copy.deepcopy((args, kwargs))))
            return method(kernels, *args, **kwargs)

        return call

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    def run(self, calls) -> list:
        """The calls again, unrecorded."""
        return [self.methods[name](self.kernels, *args, **kwargs) for name, args, kwargs in calls]

    def check_compiles(self, calls) -> None:
        """The calls compile into one graph and do what they do uncompiled: outputs and writes."""
        eager_in, compiled_in = copy.deepcopy(calls), copy.deepcopy(calls)
        expect = self.run(eager_in)
        torch._dynamo.reset()
        got = torch.compile(self.run, fullgraph=True, dynamic=False, backend=BACKEND)(compiled_in)
        pairs = zip(torch.utils._pytree.tree_leaves((expect, eager_in)), torch.utils._pytree.tree_leaves((got, compiled_in)))
        checked = 0
        for x, y in pairs:
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, equal_nan=True)
                checked += 1
        assert checked > 0


def by_layer(calls) -> list[list]:
    """A step's calls, one list per layer (each layer's start with its token's append)."""
    layers = []
    for call in calls:
        if call[0] == "append" or not layers:
            layers.append([])
        layers[-1].append(call)
    return layers


def segments(calls) -> tuple[list, list]:
    """One layer's calls -> (before its host interaction, after it)."""
    cut = next((i for i, (name, _, _) in enumerate(calls) if name in AFTER_SYNC), len(calls))
    return calls[:cut], calls[cut:]


def names(calls) -> list[str]:
    return [name for name, _, _ in calls]


@pytest.mark.parametrize("batch", [1, 4])
def test_each_segment_of_a_layer_compiles_whole(daemon, monkeypatch, batch):
    assert set(triton_ops.registered()) == set(triton_ops.OPS)
    shape = ModelShape(1, 1, 2, 32, torch.float32)  # small: the interpreter runs every program in Python
    g = torch.Generator().manual_seed(batch)

    def step():
        q, k, v = (torch.randn(batch, n, shape.head_dim, generator=g) for n in (2, 1, 1))
        kv.decode(0, q, k, v)

    with daemon.client() as store:
        kv = SparseKV(store, shape, batch=batch, kernels="triton", pipeline=False, budget=0.25)
        try:
            kv.prefill(0, *(torch.randn(batch, n, 256 - 3, shape.head_dim, generator=g) for n in (2, 1, 1)))
            step()  # the first step sizes what later ones reuse
            for _ in range(kv.session.cfg.page_size - 3):  # pages end where the prompt does
                step()
            rec = Recorder(monkeypatch)
            for completes_page in (False, True):  # the second step completes a page
                step()
                before, after = segments(rec.take())
                assert names(before)[0] == "append" and names(before)[-2:] == ["lowrank_choose", "place"]
                assert ("lowrank_add_page" in names(before)) == completes_page
                assert names(after)[-1] == "attend_window"
                if completes_page or batch == 1:  # batch 4: the page step's segments hold every call (time)
                    for segment in (before, after):
                        rec.check_compiles(segment)
        finally:
            kv.close()


def test_the_global_layers_of_a_hybrid_model_compile_whole(daemon, monkeypatch):
    model = hybrid("gemma3", [S, S, F, S, F], seed=2)
    ids, mask = left_padded([200, 150])
    rec = Recorder(monkeypatch)
    with daemon.client() as store:
        handle = attach(model, store, kernels="triton", budget=0.25)
        try:
            generate(model, ids, mask, new=2)  # prefill, then one decode step
        finally:
            handle.detach()
    layers = by_layer(rec.take())
    assert len(layers) == 2  # the two global layers; the sliding ones stay the model's
    for calls in layers:
        before, after = segments(calls)
        assert names(before)[-2:] == ["lowrank_choose", "place"] and names(after)[-1] == "attend_window"
        for segment in (before, after):
            rec.check_compiles(segment)
