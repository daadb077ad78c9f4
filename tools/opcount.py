"""Count the torch ops and host-synchronising ops of KVDrive's decode, per layer and step.

A decode step on a GPU pays for every kernel launch and, far more, for every op that
makes the host wait for the device: a copy to the host (``.cpu()``, ``.tolist()``),
a data-dependent shape (``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``) or a scalar read (``.item()``, ``int(t)``, ``bool(t)``). This counts both
while KVDrive decodes CPU tensors, so CI can check a CUDA code path without a GPU:
run it with ``kernels="reference"`` (the path a CUDA device takes).

``python -m kvdrive.tools.opcount`` prints the counts for a small synthetic model
through :class:`kvdrive_client.engine.SparseKV` against an embedded ``kvstored``;
:class:`OpCounter` is the counter itself, for tests.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for on a CUDA device.
SYNC_OPS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::_unique2",
            "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"}
# Tensor methods that copy to the host (on CPU tensors they are no-ops the dispatcher never sees).
HOST_COPIES = ("cpu", "tolist")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it (``ops``) and those that synchronise the
    host with the device (``syncs``, by name; copies to the host as ``Tensor.cpu`` and
    ``Tensor.tolist``). Use as a context manager; counting can be paused with :meth:`paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self._on = True
        self._saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._on:
            name = func._schema.name
            self.ops[name] += 1
            if name in SYNC_OPS:
                self.syncs[name] += 1
            elif name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                               for i in (args[1] if len(args) > 1 else ())):
                self.syncs["aten::index (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_COPIES:
            method = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved.clear()
        return super().__exit__(*exc)

    def _counted(self, name: str, method):
        def counted(tensor, *args, **kwargs):
            if self._on:
                self.syncs[f"Tensor.{name}"] += 1
            return method(tensor, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def paused(self):
        on, self._on = self._on, False
        try:
            yield
        finally:
            self._on = on

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


def count_decode(store, kernels: str = "reference", steps: int = 6, warmup: int = 2, batch: int = 2,
                 layers: int = 2, **options) -> dict:
    """Decode a small random model through SparseKV; the ops per layer and step, counted
    over ``steps`` steps after ``warmup`` uncounted ones."""
    from kvdrive_client.engine import ModelShape, SparseKV  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    h, hq, d, t = 2, 4, 32, 640
    kv = SparseKV(store, ModelShape(layers, h, hq, d, torch.float32), batch=batch, kernels=kernels,
                  pipeline=False, budget=0.125, **options)
    counter = OpCounter()
    try:
        for layer in range(layers):
            kv.prefill(layer, torch.randn(batch, hq, t, d, generator=g), torch.randn(batch, h, t, d, generator=g),
                       torch.randn(batch, h, t, d, generator=g))
        with counter:
            for step in range(warmup + steps):
                for layer in range(layers):
                    with counter.paused():
                        q, k, v = (torch.randn(batch, n, d, generator=g) for n in (hq, h, h))
                    if step < warmup:
                        with counter.paused():
                            kv.decode(layer, q, k, v)
                    else:
                        kv.decode(layer, q, k, v)
        stats = dict(kv.stats)
    finally:
        kv.close()
    per = steps * layers
    return {"kernels": kernels, "ops_per_layer_step": counter.num_ops / per,
            "syncs_per_layer_step": counter.num_syncs / per,
            "syncs": {k: v / per for k, v in sorted(counter.syncs.items())},
            "top_ops": {k: v / per for k, v in counter.ops.most_common(12)}, "misses": stats["misses"],
            "pages_flushed": stats.get("pages_flushed", 0)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvdrive.tools.opcount", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["reference", "cpu"], help="kernel sets to count")
    ap.add_argument("--steps", type=int, default=6, help="counted decode steps (after 2 warm-up steps)")
    args = ap.parse_args(argv)
    from kvdrive_client import connect  # noqa: PLC0415

    with connect(None) as store:  # a private embedded daemon
        for kernels in args.kernels:
            r = count_decode(store, kernels, steps=args.steps)
            print(f"kernels={kernels}: {r['ops_per_layer_step']:.1f} torch ops, {r['syncs_per_layer_step']:.1f} "
                  f"host syncs per layer per decode step ({r['misses']} misses)")
            for name, n in r["syncs"].items():
                print(f"    {name:32s} {n:6.2f}")


if __name__ == "__main__":
    main()
