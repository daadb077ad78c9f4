"""The op/sync counter, and the decode path's per-layer budgets of host synchronisations and ops."""

import os
import sys

import torch

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the interpreter is chosen at triton's first import

from kvdrive.tools.opcount import OpCounter, count_decode  # noqa: E402


def _triton_interpreted() -> bool:
    try:
        from kvdrive.kernels import triton_kernels
    except ImportError:
        return False
    return triton_kernels.INTERPRETED


# Host synchronisations per layer per decode step, at most (the path a CUDA device takes,
# counted on CPU tensors): the placement's one copy to the host, which also carries the
# figures counted on the device and the pages completed in the step.
SYNC_BUDGET = {"reference": 1.0, "cpu": 1.0, **({"triton": 1.0} if _triton_interpreted() else {})}
# Torch ops (Triton launches included) per layer with the Triton kernels, at most: in a step
# that completes no page, in one that completes a page (it indexes and queues the page), and
# over the 14 counted steps (the last completes a page). On a GPU nearly each is a launch.
TRITON_STEADY_OPS = 24
TRITON_PAGE_OPS = 40
TRITON_MEAN_OPS = 30


def test_the_counter_sees_syncs_and_host_copies():
    x = torch.arange(10.0)
    with OpCounter() as c:
        y = x * 2
        torch.nonzero(y > 4)
        int(y.sum())
        y[y > 3]
        y.cpu()
        y.tolist()
        with c.paused():
            torch.nonzero(y)
    assert c.ops["aten::mul"] == 1 and c.ops["aten::nonzero"] == 1
    assert c.syncs == {"aten::nonzero": 1, "aten::_local_scalar_dense": 1, "aten::index (boolean mask)": 1,
                       "Tensor.cpu": 1, "Tensor.tolist": 1}
    assert torch.Tensor.cpu is not None and "counted" not in torch.Tensor.cpu.__name__  # restored on exit


def test_decode_stays_within_its_sync_budget(daemon):
    with daemon.client() as store:
        for kernels, budget in SYNC_BUDGET.items():
            # 14 counted steps after 2 warm-up ones: the 16th step decoded completes the first page
            # after the prompt's (as few steps as show one; the interpreted Triton launches are slow).
            r = count_decode(store, kernels, steps=14)
            assert r["misses"] > 0 and r["pages_flushed"] == 1
            assert 0 < r["syncs_per_layer_step"] <= budget, (kernels, r["syncs"])
            assert set(r["syncs"]) == {"Tensor.cpu"}, r["syncs"]
            assert r["ops_per_layer_step"] > r["syncs_per_layer_step"]
            if kernels == "triton":
                assert r["launches_per_layer_step"] > 0 and r["steady"] <= TRITON_STEADY_OPS, r["ops"]
                assert r["page"] <= TRITON_PAGE_OPS and r["ops_per_layer_step"] <= TRITON_MEAN_OPS, r["ops"]
