"""KVDriveHiCacheStorage against SGLang's real HiCache storage base, storage config and
backend factory, driven as SGLang's cache controller drives a storage backend, against a
real kvstored."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvdrive.tools.engines import PageFirstHostPool, ShmHostAllocator

PAGE, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 16  # a page: 2 x 4 tokens x 2 layers x 2 heads x 16, bf16: 1 KiB
POOL_PAGES = 24
SRC, DST = [1, 3, 4, 7, 8, 10, 13, 15], [2, 5, 6, 9, 11, 12, 14, 16]  # host pages stored from / loaded into


@pytest.fixture
def sgl(sglang_installed):
    """SGLang's storage modules and our adapter, imported with SGLang on the path."""
    storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    adapter = importlib.reload(importlib.import_module("kvdrive_client.integrations.sglang"))
    import torch  # noqa: PLC0415 - with SGLang's modules

    return SimpleNamespace(storage=storage, factory=factory, adapter=adapter, torch=torch)


def storage_config(sgl, address, metrics=False, **config):
    """SGLang's storage config for one rank, with the dynamic backend's extra config."""
    extra = {"backend_name": "kvdrive", "module_path": "kvdrive_client.integrations.sglang",
             "class_name": "KVDriveHiCacheStorage", "interface_v1": 1, "address": address,
             **config.pop("extra", {})}
    ranks = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                 model_name="test-model")
    ranks.update(config)
    return sgl.storage.HiCacheStorageConfig(**ranks, enable_storage_metrics=metrics, is_page_first_layout=True,
                                            extra_config=extra)


def backend(sgl, daemon, pool=None, **config):
    """The backend as SGLang's cache controller attaches it: the factory, then the host pool."""
    b = sgl.factory.StorageBackendFactory.create_backend("dynamic", storage_config(sgl, daemon.address, **config),
                                                         pool)
    if pool is not None:
        b.register_mem_pool_host(pool)
    return b


def host_pool(sgl, seed=None, shm=False):
    """A host pool of SGLang's page_first layout, zeros or random bytes; ``shm``: in a memfd,
    made by SGLang's own ``shm`` host allocator (``"allocator": "shm"``)."""
    pool = PageFirstHostPool(POOL_PAGES, PAGE, LAYERS, HEADS, HEAD_DIM, sgl.torch.bfloat16,
                             ShmHostAllocator() if shm else None)
    if seed is not None:
        raw = pool.kv_buffer.view(sgl.torch.uint8)
        gen = sgl.torch.Generator().manual_seed(seed)
        raw.copy_(sgl.torch.randint(0, 256, raw.shape, dtype=sgl.torch.uint8, generator=gen))
    return pool


def page_bytes(sgl, pool, p):
    """Host page ``p``'s K and V bytes (a copy)."""
    return pool.page(p).contiguous().view(sgl.torch.uint8)


def host_indices(sgl, pages):
    """The token indices of host pages, as the controller passes them (page_size per page)."""
    return sgl.torch.cat([sgl.torch.arange(p * PAGE, (p + 1) * PAGE, dtype=sgl.torch.int64) for p in pages])


def keys(n, salt="page"):
    """SGLang's page keys: hex SHA-256 strings."""
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_implements_the_storage_interface_and_the_factory_builds_it(sgl, daemon):
    cls = sgl.adapter.KVDriveHiCacheStorage
    abstract = sgl.storage.HiCacheStorage.__abstractmethods__
    assert abstract >= {"get", "batch_get", "set", "batch_set", "exists"}
    assert not cls.__abstractmethods__
    for name in [*abstract, "batch_exists", "batch_get_v1", "batch_set_v1", "register_mem_pool_host", "clear",
                 "get_stats"]:
        assert name in cls.__dict__, f"{name} is not implemented"
        ours, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(sgl.storage.HiCacheStorage,
                                                                                          name))
        assert list(ours.parameters) == list(theirs.parameters), name

    pool = host_pool(sgl)
    b = backend(sgl, daemon, pool)
    assert isinstance(b, cls)
    assert b.store.ns == "sglang/test-model/default/b1024/tp0of1.page_first.bfloat16"
    other = backend(sgl, daemon, pool, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, extra={"tenant": "t"})
    assert other.store.ns == "sglang/test-model/t/b1024/tp1of2-pp1of2.page_first.bfloat16"
    mla = backend(sgl, daemon, pool, is_mla_model=True, tp_rank=3, tp_size=4, extra={"interface_v1": 0})
    assert mla.store.ns == "sglang/test-model/default/b1024/mla.page_first-flat.bfloat16"
    with pytest.raises(ValueError, match="needs the model's name"):
        backend(sgl, daemon, model_name=None)
    with pytest.raises(ValueError, match="page regions are 1024 bytes, its pages 1028"):
        backend(sgl, daemon, OddPool(POOL_PAGES, PAGE, LAYERS, HEADS, HEAD_DIM))
    assert backend(sgl, daemon, model_name=None, extra={"model": "m"}).model == "m"
    for made in (b, other, mla):
        made.close()


class OddPool(PageFirstHostPool):
    """A host pool whose pages are not the regions it reports."""

    def get_size_per_token(self) -> int:
        return super().get_size_per_token() + 1


def test_without_sglang_the_module_imports_and_names_the_pin():
    code = ("import sys\nsys.modules['sglang'] = None  # not importable, even where it is installed\n"
            "import kvdrive_client.integrations.sglang as m\n"
            "try:\n    m.KVDriveHiCacheStorage\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "sglang==0.5.23" in out.stdout


def test_controller_sequence_stores_and_loads_pages(sgl, daemon):
    torch = sgl.torch
    pool = host_pool(sgl, seed=1)
    b = backend(sgl, daemon, pool)
    ks = keys(8)
    assert b.batch_exists(ks) == 0
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [False] * 8

    assert b.batch_set_v1(ks, host_indices(sgl, SRC)) == [True] * 8
    assert b.batch_exists(ks) == 8
    assert b.batch_exists([ks[0], ks[1], keys(1, "unknown")[0], ks[3]]) == 2
    assert b.exists(ks[5]) and not b.exists(keys(1, "unknown")[0])

    stored = [page_bytes(sgl, pool, p) for p in SRC]
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [True] * 8
    for want, p in zip(stored, DST):
        got = page_bytes(sgl, pool, p)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # K, V
    untouched = [p for p in range(POOL_PAGES) if p not in DST]
    assert all(not page_bytes(sgl, pool, p).any() for p in untouched)

    assert b.batch_get_v1(ks, host_indices(sgl, DST)[:-1]) == [False] * 8  # not whole pages: nothing moves

    before = b.stats()
    assert b.batch_set_v1(ks, host_indices(sgl, DST)) == [True] * 8
    after = b.stats()
    assert after["blocks_stored"] == before["blocks_stored"] == 8
    assert after["stored_before"] == before.get("stored_before", 0) + 8
    b.close()


def test_a_shared_memory_host_pool_moves_in_place(sgl, daemon):
    torch = sgl.torch
    pool = host_pool(sgl, seed=2, shm=True)
    b = backend(sgl, daemon, pool, extra={"allocator": "shm"})
    assert b.store.regions == 2 and b.store._shared is not None  # K and V: two regions a page
    ks = keys(8, "shm")
    assert b.batch_set_v1(ks, host_indices(sgl, SRC)) == [True] * 8
    stored = [page_bytes(sgl, pool, p) for p in SRC]
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [True] * 8
    for want, p in zip(stored, DST):
        assert torch.equal(page_bytes(sgl, pool, p), want)
    assert all(not page_bytes(sgl, pool, p).any() for p in range(POOL_PAGES) if p not in DST)
    st = b.stats()
    assert st["blocks_in_place"] == 16 and st["blocks_loaded"] == 8 and st.get("staging_us", 0) == 0
    # A backend on a pool of SGLang's default (private) memory loads the same pages through staging.
    plain = host_pool(sgl)
    other = backend(sgl, daemon, plain)
    assert other.store._shared is None and other.store.regions == 2
    assert other.batch_get_v1(ks, host_indices(sgl, SRC)) == [True] * 8
    for want, p in zip(stored, SRC):
        assert torch.equal(page_bytes(sgl, plain, p), want)
    assert other.stats().get("blocks_in_place", 0) == 0
    # Without interface_v1 SGLang passes flat page tensors, never the pool's pages: its
    # memory is not registered with kvstored, shared or not.
    flat = backend(sgl, daemon, pool, extra={"allocator": "shm", "interface_v1": 0})
    assert flat.store._shared is None and flat.store.regions == 1
    assert flat.store.wait_open(30) and flat.store.stats().get("blocks_in_place", 0) == 0
    assert all(ch._pool is None for lane in (flat.store.loads, flat.store.stores) for ch in lane._channels)
    b.close()
    other.close()
    flat.close()


def test_pages_whose_regions_kvstored_cannot_split_by_move_through_staging(sgl, daemon, caplog):
    """K and V of 6 bytes each: a page of 12 bytes is one kvstored part, which cannot lie in
    either region; the shared pool's pages are copied instead, and the backend says why."""
    pool = PageFirstHostPool(8, 1, 1, 1, 3, sgl.torch.bfloat16, ShmHostAllocator())
    raw = pool.kv_buffer.view(sgl.torch.uint8)
    raw.copy_(sgl.torch.arange(raw.numel(), dtype=sgl.torch.uint8).view(raw.shape))
    with caplog.at_level("INFO", logger="kvdrive_client.integrations.sglang"):
        b = backend(sgl, daemon, pool, extra={"allocator": "shm"})
    assert "does not split into 2 equal regions" in caplog.text
    assert b.store._shared is None and b.store.regions == 1
    ks = keys(3, "odd")
    assert b.batch_set_v1(ks, sgl.torch.arange(0, 3)) == [True] * 3
    want = [page_bytes(sgl, pool, p) for p in range(3)]
    assert b.batch_get_v1(ks, sgl.torch.arange(4, 7)) == [True] * 3
    assert all(sgl.torch.equal(page_bytes(sgl, pool, 4 + i), w) for i, w in enumerate(want))
    b.close()


def test_pages_stored_whole_before_move_through_staging_with_a_warning(sgl, daemon, caplog):
    """A namespace made with a page in one part (by a store not split by regions) cannot be
    moved in K and V regions: the shared pool's pages go through staging instead."""
    torch = sgl.torch
    pool = host_pool(sgl, seed=3, shm=True)
    ks = keys(4, "whole")
    old = sgl.adapter.BlockStore(pool.get_size_per_token() * PAGE, engine="sglang", model="test-model",
                                 rank="tp0of1.page_first.bfloat16", address=daemon.address)
    assert old.geometry.num_layers == 1
    assert old.store(ks[:2], [page_bytes(sgl, pool, p).numpy() for p in SRC[:2]]) == [True, True]
    old.close()
    b = backend(sgl, daemon, pool, extra={"allocator": "shm"})
    assert b.store._shared is not None
    with caplog.at_level("WARNING", logger="kvdrive_client.integrations.pool"):
        assert b.batch_set_v1(ks, host_indices(sgl, SRC[:4])) == [True] * 4
    assert "moves no more blocks in place" in caplog.text and "[unsupported]" in caplog.text and b.store._shared is None
    stored = [page_bytes(sgl, pool, p) for p in SRC[:4]]
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(ks, host_indices(sgl, DST[:4])) == [True] * 4
    for want, p in zip(stored, DST[:4]):
        assert torch.equal(page_bytes(sgl, pool, p), want)
    assert b.stats().get("blocks_in_place", 0) == 0
    b.close()


def test_a_rank_that_is_not_a_storage_writer_writes_nothing(sgl, daemon):
    pool = host_pool(sgl, seed=8)
    ks = keys(8, "replica")
    replica = backend(sgl, daemon, pool, is_mla_model=True, tp_rank=1, tp_size=2)  # MLA: rank 0 writes
    assert replica.batch_set_v1(ks, host_indices(sgl, SRC)) == [True] * 8
    assert replica.batch_set(ks[:1], [pool.page(0).contiguous()]) is True
    assert replica.batch_exists(ks) == 0 and not replica.stats().get("blocks_stored")
    writer = backend(sgl, daemon, pool, is_mla_model=True, tp_rank=0, tp_size=2)
    assert all(writer.batch_set_v1(ks, host_indices(sgl, SRC)))
    assert replica.batch_exists(ks) == 8  # one copy for every rank
    replica.close()
    writer.close()


def test_pages_survive_a_daemon_restart(sgl, daemon):
    pool = host_pool(sgl, seed=2)
    b = backend(sgl, daemon, pool)
    ks = keys(8, "restart")
    assert all(b.batch_set_v1(ks, host_indices(sgl, SRC)))
    stored = [page_bytes(sgl, pool, p) for p in SRC]
    b.close()
    daemon.stop()
    daemon.start()

    fresh = host_pool(sgl)
    b = backend(sgl, daemon, fresh)
    assert b.batch_exists(ks) == 8
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [True] * 8
    assert all(sgl.torch.equal(page_bytes(sgl, fresh, p), want) for p, want in zip(DST, stored))
    b.close()


@pytest.mark.alone
def test_a_daemon_that_is_down_is_misses_within_a_second(sgl, daemon):
    pool = host_pool(sgl, seed=3)
    b = backend(sgl, daemon, pool, extra={"retry_s": 0.3})
    ks, more = keys(8, "down"), keys(8, "more")
    assert all(b.batch_set_v1(ks, host_indices(sgl, SRC)))  # connected, session open
    daemon.kill9()

    calls = [(b.batch_exists, (ks,), 0), (b.batch_get_v1, (ks, host_indices(sgl, DST)), [False] * 8),
             (b.batch_set_v1, (more, host_indices(sgl, SRC)), [False] * 8), (b.exists, (ks[0],), False),
             (b.get, (more[0], sgl.torch.zeros(512, dtype=sgl.torch.bfloat16)), None)]
    for fn, args, want in calls:
        got, took = timed(fn, *args)
        assert got == want, fn.__name__
        assert took < 1.0, f"{fn.__name__} took {took:.2f} s with the daemon down"
    assert b.stats()["unavailable"] == 1

    daemon.start()  # back: used again once retry_s is over, with what it acknowledged before the kill
    time.sleep(0.3)
    assert b.batch_exists(ks) == 8
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [True] * 8
    b.close()


def test_the_controllers_threads_call_at_once(sgl, daemon):
    """SGLang's prefetch, prefetch I/O and backup threads call the backend concurrently."""
    pool = host_pool(sgl, seed=7)
    b = backend(sgl, daemon, pool)
    old, new = keys(4, "old"), keys(4, "new")
    assert all(b.batch_set_v1(old, host_indices(sgl, SRC[:4])))
    want = [page_bytes(sgl, pool, p) for p in SRC[:4]]
    calls = {"exists": (lambda: b.batch_exists(old), 4),
             "get": (lambda: b.batch_get_v1(old, host_indices(sgl, DST[:4])), [True] * 4),
             "set": (lambda: b.batch_set_v1(new, host_indices(sgl, SRC[4:])), [True] * 4)}
    seen: dict[str, list] = {name: [] for name in calls}

    def run(name):
        fn = calls[name][0]
        for _ in range(25):
            try:
                seen[name].append(fn())
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                seen[name].append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for name, (_, expected) in calls.items():
        assert seen[name] == [expected] * 25, name
    assert all(sgl.torch.equal(page_bytes(sgl, pool, p), w) for p, w in zip(DST[:4], want))
    assert b.batch_exists(old + new) == 8
    b.close()


def test_flat_page_tensors_round_trip(sgl, daemon):
    torch = sgl.torch
    b = backend(sgl, daemon, extra={"interface_v1": 0})  # SGLang's generic path: flat page tensors
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype)
        pages = [torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=gen).view(dtype) for _ in range(3)]
        k0, k1, k2, unknown = keys(4, name)

        assert b.get(k0, torch.zeros(512, dtype=dtype)) is None
        assert b.set(k0, pages[0]) and b.exists(k0)
        target = torch.zeros(512, dtype=dtype)
        assert b.get(k0, target) is target
        assert torch.equal(target.view(torch.uint8), pages[0].view(torch.uint8))

        assert b.batch_set([k1, k2], pages[1:]) is True
        targets = [torch.zeros(512, dtype=dtype) for _ in range(3)]
        got = b.batch_get([k1, unknown, k2], targets)
        assert got[1] is None and got[0] is targets[0] and got[2] is targets[2]
        assert torch.equal(targets[0].view(torch.uint8), pages[1].view(torch.uint8))
        assert torch.equal(targets[2].view(torch.uint8), pages[2].view(torch.uint8))
        assert b.batch_exists([k0, k1, k2, unknown]) == 3

    assert b.set(keys(1, "odd")[0], torch.zeros(100, dtype=torch.bfloat16)) is False  # not this backend's size
    assert b.get(keys(1, "odd")[0], torch.zeros(100, dtype=torch.bfloat16)) is None
    b.close()


def test_tenants_are_apart(sgl, daemon):
    pool = host_pool(sgl, seed=5)
    ks = keys(8, "tenant")
    a = backend(sgl, daemon, pool, extra={"tenant": "a"})
    assert all(a.batch_set_v1(ks, host_indices(sgl, SRC)))
    b = backend(sgl, daemon, pool, extra={"tenant": "b"})
    assert b.batch_exists(ks) == 0
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [False] * 8
    assert backend(sgl, daemon, pool, extra={"tenant": "a"}).batch_exists(ks) == 8
    a.close()
    b.close()


@dataclass
class StorageMetricsStandIn:
    """SGLang's ``StorageMetrics`` fields: its own module imports much of SGLang's server
    (torchvision and more), which the tests do not install."""

    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


def test_storage_metrics_are_per_call_pages_and_bandwidth(sgl, daemon, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector",
                        SimpleNamespace(StorageMetrics=StorageMetricsStandIn))
    pool = host_pool(sgl, seed=6)
    assert backend(sgl, daemon, pool).get_stats() is None  # storage metrics off
    b = backend(sgl, daemon, pool, metrics=True)
    ks = keys(8, "metrics")
    assert all(b.batch_set_v1(ks, host_indices(sgl, SRC)))
    assert all(b.batch_get_v1(ks[:5], host_indices(sgl, DST[:5])))
    m = b.get_stats()
    assert m.backup_pgs == [8] and m.prefetch_pgs == [5]
    assert len(m.backup_bandwidth) == len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
    assert b.get_stats() == StorageMetricsStandIn()  # each call reports what came since the last
    b.close()


@pytest.mark.alone
def test_a_prefetch_completes_while_a_large_backup_is_in_flight(sgl, daemon, monkeypatch):
    """The controller's backup thread holds a store (its connection and staging region)
    until released; a prefetch on another thread loads meanwhile."""
    pool = host_pool(sgl, seed=9)
    b = backend(sgl, daemon, pool)
    old, large = keys(4, "old"), keys(8, "large")
    assert all(b.batch_set_v1(old, host_indices(sgl, SRC[:4])))
    want = [page_bytes(sgl, pool, p) for p in SRC[:4]]

    blocks = type(b.store)
    original, entered, release = blocks._store_batch, threading.Event(), threading.Event()

    def held(self, *args):
        entered.set()
        assert release.wait(30), "the backup was never released"
        return original(self, *args)

    monkeypatch.setattr(blocks, "_store_batch", held)
    backup: list = []
    writer = threading.Thread(target=lambda: backup.append(b.batch_set_v1(large, host_indices(sgl, SRC))))
    writer.start()
    try:
        assert entered.wait(10)
        got, took = timed(b.batch_get_v1, old, host_indices(sgl, DST[:4]))
        assert got == [True] * 4 and took < 5.0
        assert all(sgl.torch.equal(page_bytes(sgl, pool, p), w) for p, w in zip(DST[:4], want))
        assert writer.is_alive() and not backup  # the backup is still in flight
    finally:
        release.set()
        writer.join(30)
    assert backup == [[True] * 8] and b.batch_exists(large) == 8
    b.close()


def test_clear_deletes_the_pages_this_backend_stored(sgl, daemon):
    pool = host_pool(sgl, seed=10)
    b = backend(sgl, daemon, pool)
    neighbour = backend(sgl, daemon, pool, extra={"tenant": "other"})
    replica = backend(sgl, daemon, pool, is_mla_model=True, tp_rank=1, tp_size=2)
    mla_writer = backend(sgl, daemon, pool, is_mla_model=True, tp_rank=0, tp_size=2)
    ks = keys(8, "clear")
    for made in (b, neighbour, mla_writer):
        assert all(made.batch_set_v1(ks, host_indices(sgl, SRC)))
    before = daemon.client().stats()

    replica.clear()  # not a storage writer: it stored nothing, deletes nothing
    assert mla_writer.batch_exists(ks) == 8
    b.clear()
    assert b.batch_exists(ks) == 0 and b.batch_get_v1(ks, host_indices(sgl, DST)) == [False] * 8
    assert b.stats()["blocks_deleted"] == 8
    assert neighbour.batch_exists(ks) == 8 and mla_writer.batch_exists(ks) == 8  # other namespaces kept
    after = daemon.client().stats()
    assert after["blocks"] == before["blocks"] - 8 and after["block_namespaces"] == before["block_namespaces"] - 1

    assert all(b.batch_set_v1(ks, host_indices(sgl, SRC)))  # stored again, anew
    assert b.stats()["blocks_stored"] == 16 and b.batch_exists(ks) == 8
    for made in (b, neighbour, replica, mla_writer):
        made.close()
