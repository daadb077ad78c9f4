"""The synthetic decode workload: reproducible tensors, tunable selection locality, and a run through SparseKV."""

from dataclasses import replace

import pytest
import torch

from kvdrive.tools.decode_workload import (
    DESCRIPTION,
    OverlapProbe,
    SyntheticAttention,
    calibrate_alpha,
    measure_overlap,
    selection_overlap,
)
from kvdrive_client import connect
from kvdrive_client.engine import SparseKV

TINY = dict(num_layers=2, batch=2, context_tokens=512, num_kv_heads=2, num_q_heads=8, head_dim=32, num_topics=8)
# Llama-3-8B's attention shape, short enough to measure in a second or two.
SMALL = SyntheticAttention.llama3_8b(num_layers=1, batch=2, context_tokens=4096)


def test_description_says_system_costs_only():
    assert "system costs only" in DESCRIPTION


def test_shapes_and_dtypes():
    w = SyntheticAttention(**TINY, obs_window=16)
    q, k, v = w.prefill_kv(1)
    assert q.shape == (2, 8, 16, 32) and k.shape == v.shape == (2, 2, 512, 32)
    q, k, v = w.step(0, 1)
    assert q.shape == (2, 8, 32) and k.shape == v.shape == (2, 2, 32)
    assert {t.dtype for t in (q, k, v)} == {torch.float16}
    q, k, v = replace(w, dtype=torch.float32).step(0, 0)
    assert q.dtype == k.dtype == v.dtype == torch.float32
    assert all(torch.isfinite(t.float()).all() for t in (q, k, v))


def test_same_seed_same_tensors_in_any_call_order():
    a, b = SyntheticAttention(**TINY, seed=3), SyntheticAttention(**TINY, seed=3)
    for x, y in zip(a.prefill_kv(0), b.prefill_kv(0)):
        assert torch.equal(x, y)
    in_order = [a.step(i, 0) for i in range(6)]
    for i in (5, 2, 4):  # out of order replays the walk
        for x, y in zip(in_order[i], b.step(i, 0)):
            assert torch.equal(x, y)
    other = SyntheticAttention(**TINY, seed=4)
    assert not torch.equal(other.prefill_kv(0)[1], a.prefill_kv(0)[1])
    assert not torch.equal(a.step(0, 1)[0], a.step(0, 0)[0])  # layers differ


def test_a_row_does_not_depend_on_the_batch_size_and_keys_not_on_alpha():
    one = SyntheticAttention(**{**TINY, "batch": 1}, alpha=0.3)
    two = SyntheticAttention(**TINY, alpha=0.3)
    for x, y in zip(one.prefill_kv(0), two.prefill_kv(0)):
        assert torch.equal(x[0], y[0])
    assert torch.equal(one.step(3, 0)[0][0], two.step(3, 0)[0][0])
    assert torch.equal(replace(two, alpha=0.9).prefill_kv(0)[1], two.prefill_kv(0)[1])


def test_group_queries_are_closer_to_each_other_than_to_other_heads():
    w = SyntheticAttention(**TINY)
    q = w.step(0, 0)[0].float().reshape(2, 2, 4, 32)
    q = q / q.norm(dim=-1, keepdim=True)
    within = torch.einsum("bhgd,bhkd->bhgk", q, q)[..., 0, 1:].mean()
    across = torch.einsum("bgd,bkd->bgk", q[:, 0], q[:, 1]).mean()
    assert within > across + 0.1


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="alpha"):
        SyntheticAttention(**TINY, alpha=1.0)
    with pytest.raises(ValueError, match="num_topics"):
        SyntheticAttention(**{**TINY, "num_topics": 32})
    with pytest.raises(ValueError, match="multiple of page_size"):
        SyntheticAttention(**{**TINY, "context_tokens": 500})


def test_selection_overlap_counts_shared_pages_and_ignores_none():
    prev = torch.tensor([[[1, 2, 3, 4]], [[5, 6, -1, -1]], [[7, 8, 9, 10]]])
    now = torch.tensor([[[4, 3, 9, 8]], [[6, 1, -1, -1]], [[-1, -1, -1, -1]]])
    # Stream 0: 2 of 4; stream 1: 1 of 2 (-1 never matches); stream 2 selects nothing.
    assert selection_overlap(prev, now) == pytest.approx(0.5)
    assert selection_overlap(now, now) == pytest.approx(1.0)


def test_overlap_rises_with_alpha():
    probe = OverlapProbe(SMALL, budget=0.0625)
    overlaps = [probe.overlap(alpha, steps=16) for alpha in (0.0, 0.6, 0.9, 0.99)]
    assert overlaps == sorted(overlaps) and overlaps[0] < 0.3 and overlaps[-1] > 0.8
    assert measure_overlap(replace(SMALL, alpha=0.9), steps=16) == pytest.approx(overlaps[2])


@pytest.mark.parametrize("target", [0.6, 0.85])
def test_calibration_hits_the_target(target):
    cal = calibrate_alpha(target, SMALL, steps=16, tol=0.02, proxy_tokens=2048, proxy_batch=1)
    assert abs(cal.overlap - target) <= 0.05 and abs(cal.proxy_overlap - target) <= 0.05
    assert measure_overlap(replace(SMALL, alpha=cal.alpha), steps=16) == pytest.approx(cal.overlap)


def test_an_unreachable_target_is_refused():
    with pytest.raises(ValueError, match="outside"):
        calibrate_alpha(0.01, SyntheticAttention(**{**TINY, "num_layers": 1}), steps=4, proxy_tokens=256)


def dense(q, keys, values, scale):
    g = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(g, dim=1), values.float().repeat_interleave(g, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
    return torch.einsum("bht,bhtd->bhd", torch.softmax(logits, -1), v)


# fp16 attention rounds its probabilities and sums to fp16; the reference is float32.
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)], ids=["fp32", "fp16"])
def test_runs_through_sparse_kv_and_matches_dense_at_full_budget(dtype, tol):
    w = SyntheticAttention(**TINY, alpha=0.9, dtype=dtype)
    store = connect(None, dram="64M", ssd_max="1G")
    try:
        kv = SparseKV(store, w.shape, batch=w.batch, budget=1.0)
        keys, values = [], []
        for layer in range(w.num_layers):
            query, k, v = w.prefill_kv(layer)
            kv.prefill(layer, query, k, v)
            keys.append(k)
            values.append(v)
        for step in range(3):
            for layer in range(w.num_layers):
                q, k, v = w.step(step, layer)
                keys[layer] = torch.cat([keys[layer], k[:, :, None]], dim=2)
                values[layer] = torch.cat([values[layer], v[:, :, None]], dim=2)
                out = kv.decode(layer, q, k, v)
                assert out.shape == q.shape and torch.isfinite(out).all()
                torch.testing.assert_close(out.float(), dense(q, keys[layer], values[layer], w.scaling),
                                           atol=tol, rtol=tol)
        kv.close()
    finally:
        store.close()
