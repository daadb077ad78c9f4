"""KVDriveTier against vLLM's real tiering base classes and job types, driven as vLLM's
tiering manager drives a secondary tier, against a real kvstored."""

from __future__ import annotations

import importlib
import inspect
import time
from types import SimpleNamespace

import numpy as np
import pytest

BLOCK = 64 << 10  # bytes per CPU-tier chunk (a small model's block; the benchmark uses Llama-3-8B's)
CHUNKS = 32


@pytest.fixture
def vllm(vllm_installed):
    """vLLM's modules and our adapter, imported with vLLM on the path."""
    base = importlib.import_module("vllm.v1.kv_offload.base")
    tiering = importlib.import_module("vllm.v1.kv_offload.tiering.base")
    factory = importlib.import_module("vllm.v1.kv_offload.tiering.factory")
    config = importlib.import_module("vllm.v1.kv_offload.config")
    adapter = importlib.reload(importlib.import_module("kvdrive_client.integrations.vllm"))
    return SimpleNamespace(base=base, tiering=tiering, factory=factory, config=config, adapter=adapter)


def offloading_spec(vllm, model="meta-llama/Llama-3.1-8B", tp=1):
    c = vllm.config
    cfg = c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0",), group_id=0),),
        worker_kv_bytes_per_block=BLOCK, enable_kv_cache_events=False, extra_config={}, engine_id="e0",
        model=c.OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                            data_parallel_index=0, data_parallel_size=1,
                                            data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    return SimpleNamespace(config=cfg)  # the tier reads only the spec's config


def make_tier(vllm, daemon, primary, **options):
    """The tier as vLLM builds it: its factory, an out-of-tree type by module path."""
    tier_config = {"type": "KVDriveTier", "module_path": "kvdrive_client.integrations.vllm",
                   "address": daemon.address, "retry_s": 0.5, **options}
    return vllm.factory.SecondaryTierFactory.create_secondary_tier(tier_config, memoryview(primary),
                                                                    offloading_spec(vllm))


def keys(n, salt=b"k"):
    return [salt + i.to_bytes(4, "little") + b"\0" * 11 for i in range(n)]


def ctx(vllm, rid="r0"):
    return vllm.base.ReqContext(req_id=rid)


def step_end(vllm, tier):
    tier.on_schedule_end(vllm.base.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def settle(vllm, tier, ks, timeout=5.0):
    """Look ``ks`` up as the scheduler does, a step at a time, until none answers RETRY."""
    LR = vllm.base.LookupResult
    deadline = time.monotonic() + timeout
    while True:
        results = [tier.lookup(k, ctx(vllm)) for k in ks]
        if LR.RETRY not in results:
            return results
        assert time.monotonic() < deadline, f"lookups still RETRY after {timeout} s"
        step_end(vllm, tier)
        time.sleep(0.005)


def finish(tier, job_id, timeout=10.0):
    """Poll get_finished_jobs as the manager does until ``job_id``'s result comes (results of
    other jobs are kept for their own wait)."""
    seen = tier.__dict__.setdefault("_test_results", {})
    deadline = time.monotonic() + timeout
    while job_id not in seen:
        for r in tier.get_finished_jobs():
            assert r.job_id not in seen, f"job {r.job_id} finished twice"
            seen[r.job_id] = r
        assert job_id in seen or time.monotonic() < deadline, f"job {job_id} did not finish in {timeout} s"
        time.sleep(0.005)
    return seen.pop(job_id)


def job(vllm, job_id, ks, chunks, promotion):
    return vllm.tiering.TransferJob(job_id=job_id, keys=ks, chunk_ids=np.asarray(chunks, dtype=np.int64),
                                    is_promotion=promotion, req_context=ctx(vllm))


@pytest.fixture
def primary():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (CHUNKS, BLOCK), dtype=np.uint8)


def test_every_abstract_method_is_implemented(vllm):
    tier_cls = vllm.adapter.KVDriveTier
    assert issubclass(tier_cls, vllm.tiering.SecondaryTierManager)
    abstract = vllm.tiering.SecondaryTierManager.__abstractmethods__
    assert abstract >= {"lookup", "submit_store", "submit_load", "get_finished_jobs", "drain_jobs", "on_new_request"}
    assert not inspect.isabstract(tier_cls)
    for name in abstract | {"touch", "on_request_finished", "shutdown", "has_pending_work", "on_schedule_end"}:
        if hasattr(vllm.tiering.SecondaryTierManager, name):
            assert name in tier_cls.__dict__ or name not in abstract, name
    assert tier_cls.cache_hit_source is not None and tier_cls.medium is vllm.base.Medium.STORAGE


def test_lookup_store_load_and_a_restart_between_store_and_load(vllm, daemon, primary):
    LR = vllm.base.LookupResult
    tier = make_tier(vllm, daemon, primary)
    ks = keys(8)
    assert tier.on_new_request(ctx(vllm)).policy is not None
    assert [tier.lookup(k, ctx(vllm)) for k in ks] == [LR.RETRY] * 8  # never blocks: asked at the step's end
    assert tier.has_pending_work()
    assert settle(vllm, tier, ks) == [LR.MISS] * 8

    tier.submit_store(job(vllm, 1, ks, range(8), promotion=False))
    r = finish(tier, 1)
    assert r.success and r.transfer_bytes == 8 * BLOCK
    assert [tier.lookup(k, ctx(vllm)) for k in ks] == [LR.HIT] * 8  # known here at once
    assert "kvdrive" not in tier.store.ns and tier.store.ns.startswith("vllm/meta-llama_Llama-3.1-8B:bfloat16/")

    # A tier of another scheduler (or after vLLM restarts) finds them in kvstored.
    other = make_tier(vllm, daemon, primary)
    assert settle(vllm, other, ks + keys(1, b"x")) == [LR.HIT] * 8 + [LR.MISS]

    daemon.stop()
    daemon.start()
    primary[8:16] = 0
    tier.submit_load(job(vllm, 2, ks, range(8, 16), promotion=True))
    r = finish(tier, 2)
    assert r.success and r.successful_keys is None and r.transfer_bytes == 8 * BLOCK
    np.testing.assert_array_equal(primary[8:16], primary[0:8])  # loaded bytes are the stored bytes

    # Storing again is write-once and idempotent.
    before = tier.store.stats().get("blocks_stored", 0)
    tier.submit_store(job(vllm, 3, ks, range(8), promotion=False))
    assert finish(tier, 3).success and tier.store.stats().get("blocks_stored", 0) == before
    tier.on_request_finished(ctx(vllm))
    tier.drain_jobs()
    assert not tier.has_pending_work()
    for t in (tier, other):
        t.shutdown()


def test_a_partial_load_names_the_keys_that_loaded(vllm, daemon, primary):
    tier = make_tier(vllm, daemon, primary)
    ks = keys(4, b"p")
    tier.submit_store(job(vllm, 1, ks[:2], [0, 1], promotion=False))
    assert finish(tier, 1).success
    tier.submit_load(job(vllm, 2, ks, [10, 11, 12, 13], promotion=True))
    r = finish(tier, 2)
    assert not r.success and set(r.successful_keys) == set(ks[:2])
    np.testing.assert_array_equal(primary[10:12], primary[0:2])
    tier.shutdown()


def test_a_killed_daemon_is_misses_within_a_second_and_a_daemon_back_is_used(vllm, daemon, primary):
    LR = vllm.base.LookupResult
    tier = make_tier(vllm, daemon, primary)
    stored = keys(4, b"s")
    tier.submit_store(job(vllm, 1, stored, range(4), promotion=False))
    assert finish(tier, 1).success
    daemon.kill9()

    t0 = time.monotonic()
    fresh = keys(4, b"f")
    assert settle(vllm, tier, fresh, timeout=1.0) == [LR.MISS] * 4
    tier.submit_store(job(vllm, 2, fresh, range(4, 8), promotion=False))
    tier.submit_load(job(vllm, 3, stored, range(8, 12), promotion=True))
    assert not finish(tier, 2, timeout=1.0).success
    assert not finish(tier, 3, timeout=1.0).success
    assert time.monotonic() - t0 < 1.5, "a dead daemon held the tier up"
    assert tier.store.stats()["unavailable"] >= 1

    daemon.start()
    time.sleep(0.6)  # retry_s: the next call tries the daemon again
    other = keys(2, b"o")
    assert settle(vllm, tier, other, timeout=5.0) == [LR.MISS] * 2
    tier.submit_store(job(vllm, 4, other, [0, 1], promotion=False))
    assert finish(tier, 4).success
    tier.drain_jobs()
    tier.shutdown()


def test_tenants_and_models_are_apart(vllm, daemon, primary):
    LR = vllm.base.LookupResult
    a = make_tier(vllm, daemon, primary, tenant="a")
    b = make_tier(vllm, daemon, primary, tenant="b")
    c = make_tier(vllm, daemon, primary, tenant="a", model="another-model")
    ks = keys(2, b"t")
    a.submit_store(job(vllm, 1, ks, [0, 1], promotion=False))
    assert finish(a, 1).success
    assert settle(vllm, b, ks) == [LR.MISS] * 2
    assert settle(vllm, c, ks) == [LR.MISS] * 2
    for t in (a, b, c):
        t.shutdown()


def test_a_bad_configuration_is_refused_in_words(vllm, daemon):
    spec = SimpleNamespace(config=None)  # no model name to be found
    with pytest.raises(ValueError, match="needs the model's name"):
        vllm.adapter.KVDriveTier(spec, memoryview(np.zeros((2, BLOCK), np.uint8)), "KVDriveTier",
                                 address=daemon.address)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        vllm.adapter.KVDriveTier(spec, memoryview(np.zeros((2, 6), np.uint8)), "KVDriveTier", model="m",
                                 address=daemon.address)


def test_the_module_imports_without_vllm_and_says_what_is_missing():
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import kvdrive_client.integrations.vllm as m\n"
            "try:\n    m.KVDriveTier\nexcept ImportError as e:\n    print('ImportError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ImportError" in out.stdout and "vllm==0.34.0" in out.stdout
