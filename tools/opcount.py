"""Count the torch ops and host-synchronising ops of KVDrive's decode, per layer and step.

A decode step on a GPU pays for every kernel launch and, far more, for every op that
makes the host wait for the device: a copy to the host (``.cpu()``, ``.tolist()``),
a data-dependent shape (``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``) or a scalar read (``.item()``, ``int(t)``, ``bool(t)``). This counts both
while KVDrive decodes CPU tensors, so CI can check a CUDA code path without a GPU:
run it with ``kernels="reference"`` or ``kernels="triton"`` (the paths a CUDA device takes).

A Triton kernel launch counts as one op (``triton::<kernel>``), as it is one launch on a
GPU; under Triton's interpreter the torch ops the interpreter itself runs to move each
argument to the host and back are not counted.

KVDrive's Triton launches go through torch custom ops (``kvdrive::*``, so that a step's
segments trace: :mod:`kvdrive.kernels.triton_ops`); under the interpreter such an op is
not counted itself, the launches inside it are.

``python -m kvdrive.tools.opcount`` prints the counts for a small synthetic model
through :class:`kvdrive_client.engine.SparseKV` against an embedded ``kvstored``;
:class:`OpCounter` is the counter itself, for tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for on a CUDA device.
SYNC_OPS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::_unique2",
            "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"}
# Tensor methods that copy to the host (on CPU tensors they are no-ops the dispatcher never sees).
HOST_COPIES = ("cpu", "tolist")
# Where an op is attributed with ``sites=True``: the innermost frame in these folders.
_SITE_ROOTS = tuple(str(Path(__file__).resolve().parents[1] / d) for d in ("client", "kernels"))


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it (``ops``) and those that synchronise the
    host with the device (``syncs``, by name; copies to the host as ``Tensor.cpu`` and
    ``Tensor.tolist``). Use as a context manager; counting can be paused with :meth:`paused`.

    Interpreted Triton launches count as one op each, ``triton::<kernel>``. With ``sites``,
    ``by_site`` counts the ops per ``file:function`` of the innermost client or kernel frame."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.by_site: Counter = Counter()
        self._sites = sites
        self._on = True
        self._saved: dict = {}
        self._launch = None

    def _count(self, name: str) -> None:
        self.ops[name] += 1
        if self._sites:
            self.by_site[f"{_site()} {name}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._on:
            name = func._schema.name
            if name.startswith("kvdrive::") and self._launch is not None:
                # KVDrive's Triton launches as torch ops (kvdrive.kernels.triton_ops): the interpreted
                # launches inside are counted, one op each.
                return func(*args, **(kwargs or {}))
            self._count(name)
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
        executor = _interpreter_executor()
        if executor is not None:
            self._launch = (executor, executor.__call__)
            executor.__call__ = self._counted_launch(executor.__call__)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved.clear()
        if self._launch is not None:
            executor, call = self._launch
            executor.__call__ = call
            self._launch = None
        return super().__exit__(*exc)

    def _counted_launch(self, call):
        counter = self

        def launch(executor, *args, **kwargs):
            if counter._on:
                counter._count(f"triton::{getattr(executor.fn, '__name__', 'kernel')}")
            with counter.paused():  # the interpreter's own copies to the host and back
                return call(executor, *args, **kwargs)

        return launch

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
    def num_launches(self) -> int:
        """Triton launches among :attr:`ops`."""
        return sum(n for name, n in self.ops.items() if name.startswith("triton::"))

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


def _interpreter_executor():
    """Triton's interpreter's launcher class, when triton is imported and interpreting."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    kernels = sys.modules.get("kvdrive.kernels.triton_kernels")
    if interpreter is None or kernels is None or not kernels.INTERPRETED:
        return None
    return interpreter.GridExecutor


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SITE_ROOTS) and not path.endswith("opcount.py"):
            return f"{Path(path).parent.name}/{Path(path).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "(elsewhere)"


def count_decode(store, kernels: str = "reference", steps: int = 6, warmup: int = 2, batch: int = 2,
                 layers: int = 2, sites: bool = False, device: str = "cpu", **options) -> dict:
    """Decode a small random model through SparseKV; the ops per layer and step, counted
    over ``steps`` steps after ``warmup`` uncounted ones (a prompt of 640 tokens, pages of
    16: the 16th counted step completes a page). ``steady``/``page``: the ops per layer of
    the steps that complete no page / one (None when there were none). On a CUDA
    ``device`` the torch profiler also counts the kernel launches and copies the host
    issues (``cuda_launches_per_layer_step``, ``cuda_copies_per_layer_step``)."""
    from kvdrive_client.engine import ModelShape, SparseKV  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    h, hq, d, t = 2, 4, 32, 640
    kv = SparseKV(store, ModelShape(layers, h, hq, d, torch.float32), batch=batch, kernels=kernels, device=device,
                  pipeline=False, budget=0.125, **options)
    counter = OpCounter(sites=sites)
    per_step: dict[bool, list[int]] = {False: [], True: []}  # ops of each step, by whether it completed a page

    def rand(*size):
        return torch.randn(*size, generator=g).to(device)

    cuda = torch.device(device).type == "cuda"
    try:
        for layer in range(layers):
            kv.prefill(layer, rand(batch, hq, t, d), rand(batch, h, t, d), rand(batch, h, t, d))
        for step in range(warmup):
            for layer in range(layers):
                kv.decode(layer, rand(batch, hq, d), rand(batch, h, d), rand(batch, h, d))
        inputs = [[[rand(batch, n, d) for n in (hq, h, h)] for _ in range(layers)] for _ in range(steps)]
        with _cuda_profile(cuda) as prof, counter:
            for step in range(steps):
                before, pages = counter.num_ops, kv.session.num_pages(0)
                for layer in range(layers):
                    kv.decode(layer, *inputs[step][layer])
                per_step[kv.session.num_pages(0) > pages].append(counter.num_ops - before)
        stats = dict(kv.stats)
    finally:
        kv.close()
    per = steps * layers
    cuda_counts = _cuda_counts(prof, per) if cuda else {}

    def mean(ops):
        return sum(ops) / (len(ops) * layers) if ops else None

    return {"kernels": kernels, "ops_per_layer_step": counter.num_ops / per,
            "syncs_per_layer_step": counter.num_syncs / per, "steady": mean(per_step[False]),
            "page": mean(per_step[True]), "launches_per_layer_step": counter.num_launches / per,
            "syncs": {k: v / per for k, v in sorted(counter.syncs.items())},
            "ops": {k: v / per for k, v in counter.ops.most_common()},
            "sites": {k: v / per for k, v in counter.by_site.most_common()},
            "top_ops": {k: v / per for k, v in counter.ops.most_common(12)}, "misses": stats["misses"],
            "pages_flushed": stats.get("pages_flushed", 0), **cuda_counts}


# What the host calls to start work on a CUDA device, as the torch profiler names them.
CUDA_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
CUDA_COPIES = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync")


@contextlib.contextmanager
def _cuda_profile(on: bool):
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield prof
    torch.cuda.synchronize()


def _cuda_counts(prof, per: int) -> dict:
    names = Counter(e.name for e in prof.events())
    return {"cuda_launches_per_layer_step": sum(names[n] for n in CUDA_LAUNCHES) / per,
            "cuda_copies_per_layer_step": sum(names[n] for n in CUDA_COPIES) / per}


def _print(r: dict, top: int) -> None:
    split = "".join(f", {r[key]:.1f} in steps {what}" for key, what in (("steady", "completing no page"),
                                                                     ("page", "completing one"))
                    if r[key] is not None)
    print(f"kernels={r['kernels']}: {r['ops_per_layer_step']:.1f} torch ops ({r['launches_per_layer_step']:.1f} "
          f"Triton launches){split}, {r['syncs_per_layer_step']:.1f} host syncs per layer per decode step "
          f"({r['misses']} misses)")
    if "cuda_launches_per_layer_step" in r:
        print(f"    on the device: {r['cuda_launches_per_layer_step']:.1f} kernel launches and "
              f"{r['cuda_copies_per_layer_step']:.1f} copies or memsets per layer per decode step (torch profiler)")
    for name, n in r["syncs"].items():
        print(f"    {name:32s} {n:6.2f}")
    for title, key in (("ops by name", "ops"), ("ops by site", "sites")):
        if top and r[key]:
            print(f"  {title}:")
            for name, n in list(r[key].items())[:top]:
                print(f"    {n:6.2f}  {name}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvdrive.tools.opcount", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["reference", "cpu"], help="kernel sets to count")
    ap.add_argument("--steps", type=int, default=6, help="counted decode steps (after 2 warm-up steps; 16 or "
                    "more include one that completes a page)")
    ap.add_argument("--top", type=int, default=0, help="also print the N most frequent ops by name")
    ap.add_argument("--sites", action="store_true", help="with --top, also the ops per site (file:function)")
    ap.add_argument("--device", default="cpu", help="where the decode runs (cuda: the profiler also counts its kernel "
                    "launches)")
    args = ap.parse_args(argv)
    if "triton" in args.kernels and "triton" not in sys.modules:
        # The counts are taken on CPU tensors: the Triton kernels run there under Triton's
        # interpreter, which triton chooses at its first import (that is, now).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kvdrive_client import connect  # noqa: PLC0415

    with connect(None) as store:  # a private embedded daemon
        for kernels in args.kernels:
            _print(count_decode(store, kernels, steps=args.steps, sites=args.sites, device=args.device), args.top)


if __name__ == "__main__":
    main()
