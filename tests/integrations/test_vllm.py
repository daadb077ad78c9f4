"""KVDriveTier against vLLM's real tiering base classes and job types, driven as vLLM's
tiering manager drives a secondary tier, against a real kvstored."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
import threading
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


def offloading_spec(vllm, model="meta-llama/Llama-3.1-8B", tp=1, events=False):
    c = vllm.config
    cfg = c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0",), group_id=0),),
        worker_kv_bytes_per_block=BLOCK, enable_kv_cache_events=events, extra_config={}, engine_id="e0",
        model=c.OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                            data_parallel_index=0, data_parallel_size=1,
                                            data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    # The tier reads only these of the spec (OffloadingSpec builds kv_events_config from the config).
    events_config = vllm.base.OffloadingKVEventsConfig(enable_kv_cache_events=events,
                                                      self_describing_kv_events=False)
    return SimpleNamespace(config=cfg, kv_events_config=events_config)


def make_tier(vllm, daemon, primary, events=False, **options):
    """The tier as vLLM builds it: its factory, an out-of-tree type by module path."""
    tier_config = {"type": "KVDriveTier", "module_path": "kvdrive_client.integrations.vllm",
                   "address": daemon.address, "retry_s": 0.5, **options}
    return vllm.factory.SecondaryTierFactory.create_secondary_tier(tier_config, memoryview(primary),
                                                                    offloading_spec(vllm, events=events))


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


@pytest.fixture(params=["shared-region", "private"])
def primary(request, vllm_installed):
    """vLLM's CPU tier: its own SharedOffloadRegion (a file in /dev/shm, which kvstored
    reads and writes in place), or memory of this process only (moved through staging)."""
    data = np.random.default_rng(0).integers(0, 256, (CHUNKS, BLOCK), dtype=np.uint8)
    if request.param == "private":
        yield data
        return
    regions = importlib.import_module("vllm.v1.kv_offload.cpu.shared_offload_region")
    region = regions.SharedOffloadRegion(engine_id=f"kvdrive-test-{os.getpid()}-{time.monotonic_ns()}",
                                         num_chunks=CHUNKS, rank=None, kv_bytes_per_chunk=BLOCK, cpu_page_size=BLOCK)
    rows = np.frombuffer(region.create_kv_memoryview().cast("B"), dtype=np.uint8).reshape(CHUNKS, BLOCK)
    rows[:] = data
    yield rows
    del rows
    region.cleanup()


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


def test_lookup_store_load_and_a_restart_between_store_and_load(vllm, daemon, primary, request):
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
    # vLLM's own region is moved in place by kvstored (after its restart too), other memory through staging.
    shared = request.node.callspec.params["primary"] == "shared-region"
    assert tier.store.stats().get("blocks_in_place", 0) == (16 if shared else 0)
    assert (tier.store.stats().get("staging_us", 0) == 0) == shared

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


def test_a_load_completes_while_a_large_store_is_in_flight(vllm, daemon, primary, monkeypatch):
    """A store job holds its connection and staging region until released; a load job
    submitted after it finishes meanwhile (it never queues behind the store)."""
    tier = make_tier(vllm, daemon, primary)
    warm = keys(4, b"w")
    tier.submit_store(job(vllm, 1, warm, range(4), promotion=False))
    assert finish(tier, 1).success

    blocks = type(tier.store)
    entered, release = threading.Event(), threading.Event()

    def holding(original):  # inside the store's channel: a staging copy, or the moves of shared rows
        def held(self, *args):
            if args[0] != "load":
                entered.set()
                assert release.wait(30), "the store was never released"
            return original(self, *args)
        return held

    monkeypatch.setattr(blocks, "_store_batch", holding(blocks._store_batch))
    monkeypatch.setattr(blocks, "_pool_moves", holding(blocks._pool_moves))
    large = keys(CHUNKS - 8, b"L")
    tier.submit_store(job(vllm, 2, large, range(8, CHUNKS), promotion=False))
    assert entered.wait(10)
    primary[4:8] = 0
    tier.submit_load(job(vllm, 3, warm, range(4, 8), promotion=True))
    try:
        r = finish(tier, 3, timeout=5.0)
        assert r.success
        np.testing.assert_array_equal(primary[4:8], primary[0:4])
        assert not release.is_set() and 2 not in tier.__dict__["_test_results"]  # the store is still in flight
    finally:
        release.set()
    assert finish(tier, 2).success
    assert settle(vllm, tier, large) == [vllm.base.LookupResult.HIT] * len(large)
    tier.drain_jobs()
    tier.shutdown()


def test_an_80_mib_chunk_is_stored_and_loaded(vllm, daemon):
    """Llama-3-70B's chunk with vLLM's block_size 256: 80 layers x 8 KV heads x 128 x K, V x
    2 bytes x 256 tokens = 80 MiB, over kvstored's 64 MiB block."""
    chunk = 80 * 8 * 128 * 2 * 2 * 256
    primary = np.zeros((1, chunk), np.uint8)
    primary[0, ::4096] = np.arange(chunk // 4096, dtype=np.uint64) % 251 + 1  # a byte in every page, no two pages alike
    primary[0, -7:] = np.frombuffer(b"the end", np.uint8)
    want = hashlib.sha256(primary).digest()
    tier = make_tier(vllm, daemon, primary)
    assert tier.store.parts == 2
    k = keys(1, b"70b")
    tier.submit_store(job(vllm, 1, k, [0], promotion=False))
    assert finish(tier, 1, timeout=60).success
    primary[:] = 0
    tier.submit_load(job(vllm, 2, k, [0], promotion=True))
    r = finish(tier, 2, timeout=60)
    assert r.success and r.transfer_bytes == chunk
    assert hashlib.sha256(primary).digest() == want
    tier.shutdown()


def test_the_remembered_keys_are_bounded_and_a_forgotten_key_is_asked_again(vllm, daemon, primary):
    LR = vllm.base.LookupResult
    tier = make_tier(vllm, daemon, primary, known_keys=4)
    stored = keys(12, b"b")
    tier.submit_store(job(vllm, 1, stored, range(12), promotion=False))
    assert finish(tier, 1).success
    assert tier.stats()["known_keys"] <= 4 and tier.stats()["keys_forgotten"] >= 8
    never = keys(12, b"n")
    for _ in range(3):  # more keys than it remembers, asked again and again
        assert settle(vllm, tier, stored) == [LR.HIT] * 12  # forgotten ones: RETRY, then HIT from kvstored
        assert settle(vllm, tier, never) == [LR.MISS] * 12  # never a wrong hit
        assert tier.stats()["known_keys"] <= 4
    tier.shutdown()


def test_stored_events_where_vllm_has_kv_events_on(vllm, daemon, primary, caplog):
    base = vllm.base
    tier = make_tier(vllm, daemon, primary, events=True, enable_kv_events=True)
    ks = keys(4, b"e")
    tier.submit_store(job(vllm, 1, ks, range(4), promotion=False))
    assert finish(tier, 1).success
    tier.submit_load(job(vllm, 2, ks, range(4, 8), promotion=True))
    assert finish(tier, 2).success
    (event,) = tier.take_events()  # the store's, not the load's
    assert event.keys == ks and not event.removed and event.medium is base.Medium.STORAGE
    assert event.locality is base.Locality.LOCAL and event.ownership == "KVDriveTier"
    assert event.req_context.req_id == "r0"
    assert list(tier.take_events()) == []  # each event is taken once
    tier.shutdown()

    quiet = make_tier(vllm, daemon, primary, events=False, enable_kv_events=True)
    assert "KV cache events are off" in caplog.text
    quiet.submit_store(job(vllm, 1, keys(2, b"q"), range(2), promotion=False))
    assert finish(quiet, 1).success and list(quiet.take_events()) == []
    quiet.shutdown()


class ConnectorStatsStandIn:
    """The calls the tier makes on vLLM's ``OffloadingConnectorStats``: its module imports
    vLLM's config and much else, which the tests do not install."""

    def __init__(self):
        self.counters, self.gauges = {}, {}

    def increase_counter(self, name, value=1, labelvalues=()):
        self.counters[name, labelvalues] = self.counters.get((name, labelvalues), 0) + value

    def set_gauge(self, name, value, labelvalues=()):
        self.gauges[name, labelvalues] = value


def test_the_tiers_metrics_are_declared_and_reported_since_the_last_call(vllm, daemon, primary, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
                        SimpleNamespace(OffloadingConnectorStats=ConnectorStatsStandIn))
    LR = vllm.base.LookupResult
    definitions = vllm.adapter.KVDriveTier.build_metric_definitions({})
    assert all(isinstance(d, vllm.base.OffloadingMetricMetadata) for d in definitions.values())
    writer, tier = make_tier(vllm, daemon, primary), make_tier(vllm, daemon, primary)
    stored, never = keys(3, b"m"), keys(2, b"z")
    writer.submit_store(job(vllm, 1, stored, range(3), promotion=False))
    assert finish(writer, 1).success
    writer.shutdown()
    assert settle(vllm, tier, stored + never) == [LR.HIT] * 3 + [LR.MISS] * 2  # asked of kvstored
    first = tier.get_stats()
    looked_up = "vllm:kv_offload_kvdrive_keys_looked_up"
    assert first.counters == {(looked_up, ("found",)): 3, (looked_up, ("missing",)): 2}
    assert first.gauges == {("vllm:kv_offload_kvdrive_known_keys", ()): 3}
    assert set(first.counters) | set(first.gauges) <= {(n, v) for n, m in vllm.adapter.METRICS.items()
                                                       for _, v in m.sources}
    assert all(n in definitions for n, _ in first.counters)

    daemon.kill9()
    assert settle(vllm, tier, keys(2, b"d"), timeout=2.0) == [LR.MISS] * 2
    second = tier.get_stats()
    assert second.counters == {("vllm:kv_offload_kvdrive_unavailable", ()): 1,
                               ("vllm:kv_offload_kvdrive_blocks_failed", ("lookup",)): 2}
    tier.shutdown()


def test_store_jobs_queued_together_are_stored_by_one_call(vllm, daemon, primary, monkeypatch):
    """While the store worker is held in a job, four more are submitted: they are stored by
    one call of the block store, and each gets its own result, for its own keys."""
    tier = make_tier(vllm, daemon, primary)
    blocks = type(tier.store)
    original, entered, release, calls = blocks.store_rows, threading.Event(), threading.Event(), []

    def held(self, ks, array, rows):
        calls.append(len(ks))
        if len(calls) == 1:
            entered.set()
            assert release.wait(30), "the first store was never released"
        return original(self, ks, array, rows)

    monkeypatch.setattr(blocks, "store_rows", held)
    batches = [keys(4, b"c%d" % j) for j in range(5)]
    tier.submit_store(job(vllm, 1, batches[0], range(0, 4), promotion=False))
    assert entered.wait(10)
    for j in range(1, 5):
        tier.submit_store(job(vllm, 1 + j, batches[j], range(4 * j, 4 * j + 4), promotion=False))
    release.set()
    results = [finish(tier, j) for j in range(1, 6)]
    assert all(r.success for r in results) and [r.transfer_bytes for r in results] == [4 * BLOCK] * 5
    assert calls == [4, 16]  # the first job alone, then the four queued behind it together
    tier.drain_jobs()
    assert tier.store.lookup([k for b in batches for k in b]) == [True] * 20
    got = np.zeros_like(primary)
    out = make_tier(vllm, daemon, got)
    out.submit_load(job(vllm, 9, [k for b in batches for k in b], range(20), promotion=True))
    assert finish(out, 9).success
    np.testing.assert_array_equal(got[:20], primary[:20])
    for t in (tier, out):
        t.shutdown()


def test_load_jobs_queued_together_are_loaded_by_one_call(vllm, daemon, primary, monkeypatch):
    """While both load workers are held in a job, four more are submitted: each worker loads
    the jobs queued behind it by one call (up to LOAD_COALESCE_BYTES), every job gets its own
    result, and a job that names a missing key fails alone."""
    tier = make_tier(vllm, daemon, primary)
    stored = [keys(4, b"l%d" % j) for j in range(6)]
    tier.submit_store(job(vllm, 1, [k for b in stored for k in b], range(24), promotion=False))
    assert finish(tier, 1).success
    got = np.zeros_like(primary)
    out = make_tier(vllm, daemon, got)
    blocks = type(out.store)
    original, entered, release, calls = blocks.load, threading.Semaphore(0), threading.Event(), []

    def held(self, ks, targets):
        calls.append(len(ks))
        if len(calls) <= 2:  # both load workers
            entered.release()
            assert release.wait(30), "the first loads were never released"
        return original(self, ks, targets)

    monkeypatch.setattr(blocks, "load", held)
    out.submit_load(job(vllm, 10, stored[0], range(0, 4), promotion=True))
    assert entered.acquire(timeout=10)
    out.submit_load(job(vllm, 11, stored[1], range(4, 8), promotion=True))
    assert entered.acquire(timeout=10)
    missing = [*stored[4][:3], b"never-stored"]
    for j, (ks, rows) in enumerate([(stored[2], range(8, 12)), (stored[3], range(12, 16)), (missing, range(16, 20)),
                                    (stored[5], range(20, 24))]):
        out.submit_load(job(vllm, 12 + j, ks, rows, promotion=True))
    release.set()
    results = {j: finish(out, j) for j in range(10, 16)}
    # The four queued were taken by at most two calls: each worker takes one, then those behind it.
    assert calls[:2] == [4, 4] and sum(calls[2:]) == 16 and len(calls) <= 4, calls
    assert [results[j].success for j in range(10, 16)] == [True, True, True, True, False, True]
    assert list(results[14].successful_keys) == stored[4][:3]
    for j in (10, 11, 12, 13, 15):
        assert results[j].transfer_bytes == 4 * BLOCK
    np.testing.assert_array_equal(got[:16], primary[:16])
    np.testing.assert_array_equal(got[16:19], primary[16:19])
    np.testing.assert_array_equal(got[20:24], primary[20:24])
    for t in (tier, out):
        t.shutdown()
