"""The op/sync counter, and the decode path's per-layer budget of host synchronisations."""

import torch

from kvdrive.tools.opcount import OpCounter, count_decode

# Host synchronisations per layer per decode step, at most (the path a CUDA device takes,
# counted on CPU tensors). A change that adds one fails here; lower these as syncs go.
SYNC_BUDGET = {"reference": 14.5, "cpu": 9.5}


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
            r = count_decode(store, kernels, steps=3)
            assert r["misses"] > 0
            assert 0 < r["syncs_per_layer_step"] <= budget, (kernels, r["syncs"])
            assert r["ops_per_layer_step"] > r["syncs_per_layer_step"]
