"""KVDriveHiCacheStorage's v2 interface (hybrid models: the KV pool plus extra host pools
such as Mamba state or SWA KV), against SGLang's real HiCache storage base, dataclasses
(``PoolTransfer``, ``PoolHitPolicy``, ``PoolTransferResult``) and file backend (the
reference for ``batch_exists_v2``), driven as SGLang's hybrid cache controller drives a
storage backend, against a real kvstored. The host pools are CPU stand-ins laid out as
SGLang's (``page_first``): SGLang's own pools need a GPU device pool to be built."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import itertools
import os
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvdrive.tools.engines import PageFirstHostPool, ShmHostAllocator
from test_sglang import storage_config as v1_storage_config

PAGE, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 16  # a KV page: 2 x 4 tokens x 2 layers x 2 heads x 16, bf16: 1 KiB
POOL_PAGES = 24
MAMBA_LAYERS, TEMPORAL, CONVS = 2, (2, 4, 4), [(3, 8), (2, 5)]  # one state: 2 layers of fp32 SSM + 2 bf16 convs
MAMBA_SLOTS = 12
SWA_WINDOW = 2  # SWA pages a prefix needs: its last two


@pytest.fixture
def sgl(sglang_installed):
    """SGLang's storage modules and our adapter, imported with SGLang on the path."""
    storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    adapter = importlib.reload(importlib.import_module("kvdrive_client.integrations.sglang"))
    import torch  # noqa: PLC0415 - with SGLang's modules

    return SimpleNamespace(storage=storage, factory=factory, adapter=adapter, torch=torch,
                           KV=storage.PoolName.KV, MAMBA=storage.PoolName.MAMBA, SWA=storage.PoolName.SWA,
                           INDEXER=storage.PoolName.INDEXER, ALL=storage.PoolHitPolicy.ALL_PAGES,
                           TRAILING=storage.PoolHitPolicy.TRAILING_PAGES,
                           GROUPS=storage.PoolHitPolicy.BLOCK_GROUPS)


# ---------------------------------------------------------------- host pool stand-ins


class MambaHostPool:
    """A host Mamba state pool laid out as SGLang's ``MambaPoolHost`` with its
    ``page_first`` layout (the only one SGLang's Mamba host pool takes): one slot (page,
    ``page_size`` 1) per state, ``temporal_buffer`` ``[slots, layers, 1, *ssm_shape]`` and
    one ``conv_buffer`` ``[slots, layers, 1, *conv_shape]`` per conv state; with
    ``side_state``, a registered slot side state (``slot_state_buffers``), for which SGLang's
    pool reports no page regions (``get_page_buffer_meta`` raises) and pages move flat.
    The attributes and methods a storage backend reads compute what SGLang's do."""

    layout = "page_first"

    def __init__(self, slots=MAMBA_SLOTS, side_state=False, seed=None, shm=False):
        import torch  # noqa: PLC0415

        self.page_size, self.size, self.num_mamba_layers = 1, slots, MAMBA_LAYERS
        self.temporal_dtype, self.conv_dtype = torch.float32, torch.bfloat16
        self.dtype = self.conv_dtype
        self.temporal_state_shape, self.conv_state_shapes = TEMPORAL, CONVS
        self.temporal_state_elem_size = int(np.prod(TEMPORAL))
        self.conv_state_elem_sizes = [int(np.prod(s)) for s in CONVS]
        # shm: each buffer in a memfd, as SGLang's shm allocator makes them
        self.allocator = ShmHostAllocator() if shm else None
        alloc = self.allocator.allocate if shm else (lambda dims, dtype, device: torch.zeros(dims, dtype=dtype))
        self.temporal_buffer = alloc((slots, MAMBA_LAYERS, 1, *TEMPORAL), self.temporal_dtype, "cpu")
        self.conv_buffer = [alloc((slots, MAMBA_LAYERS, 1, *s), self.conv_dtype, "cpu") for s in CONVS]
        self.slot_state_buffers = [torch.zeros((slots, 6), dtype=torch.int32)] if side_state else []
        self.kv_buffer = [self.temporal_buffer, *self.conv_buffer, *self.slot_state_buffers]
        self.size_per_token = self.get_size_per_token()
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            for buf in self.kv_buffer:
                raw = buf.view(-1).view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))

    def get_size_per_token(self):
        conv = sum(n * self.conv_dtype.itemsize for n in self.conv_state_elem_sizes)
        side = sum(b[0].numel() * b.element_size() for b in self.slot_state_buffers)
        return (conv + self.temporal_state_elem_size * self.temporal_dtype.itemsize) * self.num_mamba_layers + side

    def _iter_page_tensors(self, index):
        yield self.temporal_buffer[index]
        yield from (conv[index] for conv in self.conv_buffer)
        yield from (state[index: index + self.page_size] for state in self.slot_state_buffers)

    def get_data_page(self, index, flat=True):
        import torch  # noqa: PLC0415

        return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in self._iter_page_tensors(index)])

    def get_dummy_flat_data_page(self):
        import torch  # noqa: PLC0415

        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        import torch  # noqa: PLC0415

        flat = data_page.contiguous().view(torch.uint8).reshape(-1)
        if flat.numel() != self.page_size * self.size_per_token:
            raise ValueError(f"Mamba state page has {flat.numel()} bytes")
        start = 0
        for t in self._iter_page_tensors(index):
            n = t.numel() * t.element_size()
            t.copy_(flat[start: start + n].clone().view(t.dtype).reshape(t.shape))
            start += n

    def get_page_buffer_meta(self, indices):
        """As SGLang's: per slot, its temporal region, then each conv state's."""
        if self.slot_state_buffers:
            raise NotImplementedError("Mamba storage zero-copy does not carry registered slot side states")
        indices = indices.tolist()
        temporal = self.num_mamba_layers * self.temporal_state_elem_size * self.temporal_dtype.itemsize
        convs = [self.num_mamba_layers * n * self.conv_dtype.itemsize for n in self.conv_state_elem_sizes]
        ptrs, sizes = [], []
        for i in range(0, len(indices), self.page_size):
            ptrs.append(self.temporal_buffer.data_ptr() + indices[i] * temporal)
            sizes.append(self.page_size * temporal)
            for buf, size in zip(self.conv_buffer, convs):
                ptrs.append(buf.data_ptr() + indices[i] * size)
                sizes.append(self.page_size * size)
        return ptrs, sizes

    def state(self, slot):
        """Slot ``slot``'s bytes (a copy)."""
        return self.get_data_page(slot).clone()


def kv_pool(sgl, seed=None, shm=False):
    """A KV (or SWA KV) host pool of SGLang's page_first layout, zeros or random bytes;
    ``shm``: in a memfd, as SGLang's ``shm`` host allocator makes it."""
    pool = PageFirstHostPool(POOL_PAGES, PAGE, LAYERS, HEADS, HEAD_DIM, sgl.torch.bfloat16,
                             ShmHostAllocator() if shm else None)
    if seed is not None:
        raw = pool.kv_buffer.view(sgl.torch.uint8)
        raw.copy_(sgl.torch.randint(0, 256, raw.shape, dtype=sgl.torch.uint8,
                                    generator=sgl.torch.Generator().manual_seed(seed)))
    return pool


def kv_page(sgl, pool, p):
    return pool.page(p).contiguous().view(sgl.torch.uint8).clone()


# ---------------------------------------------------------------- the controller's side


def storage_config(sgl, address, **config):
    """SGLang's storage config for one rank of the hybrid model (test_sglang's, renamed)."""
    return v1_storage_config(sgl, address, **{"model_name": "hybrid-model", **config})


def attach(sgl, daemon, kv, extra_pools, **config):
    """The backend as SGLang's hybrid cache controller attaches it: the factory, the anchor
    (KV) pool, then every entry of the host pool group through v2 (the anchor too), then
    ``on_host_pools_registered``."""
    b = sgl.factory.StorageBackendFactory.create_backend("dynamic", storage_config(sgl, daemon.address, **config),
                                                         kv)
    b.register_mem_pool_host(kv)
    for name, pool in [(sgl.KV, kv), *extra_pools.items()]:
        b.register_mem_host_pool_v2(pool, name)
    b.on_host_pools_registered()
    return b


def keys(n, salt="page"):
    """SGLang's page keys: hex SHA-256 strings (a chain, as far as the backend can tell)."""
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def tokens(sgl, pages, page_size=PAGE):
    """Host indices of host pages, as the controller passes them (page_size per page)."""
    return sgl.torch.cat([sgl.torch.arange(p * page_size, (p + 1) * page_size, dtype=sgl.torch.int64)
                          for p in pages]) if pages else sgl.torch.empty(0, dtype=sgl.torch.int64)


def slots(sgl, *s):
    return sgl.torch.tensor(s, dtype=sgl.torch.int64)


def transfer(sgl, name, policy, ks, host_indices=None):
    return sgl.storage.PoolTransfer(name=name, host_indices=host_indices, keys=ks, hit_policy=policy)


def backup_node(sgl, b, ks, kv_pages, mamba_slot=None, swa_pages=None):
    """One node's backup as the hybrid controller does it: the sidecars (``batch_set_v2``:
    the node's Mamba state under its last page's key, SWA's trailing window of pages),
    then the KV pages (``batch_set_v1``). The per-pool results."""
    sidecars = []
    if mamba_slot is not None:
        sidecars.append(transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[-1:], slots(sgl, mamba_slot)))
    if swa_pages is not None:
        sidecars.append(transfer(sgl, sgl.SWA, sgl.TRAILING, ks[-len(swa_pages):], tokens(sgl, swa_pages)))
    results = b.batch_set_v2(sidecars) if sidecars else {}
    results[sgl.KV] = b.batch_set_v1(ks, tokens(sgl, kv_pages))
    return results


def reference_exists(sgl, tmp_path, ks, pools, present):
    """SGLang's own file backend's ``batch_exists_v2`` over the same pages: a file per
    (pool, key) present, named as it names them."""
    cfg = storage_config(sgl, "unused")
    fb = sgl.storage.HiCacheFile(cfg, file_path=str(tmp_path / f"hicache{next(_dirs)}"))
    for name, pages in present.items():
        for i in pages:
            key = fb._get_component_key(ks[i], None if name == sgl.KV else name)
            open(os.path.join(fb.file_path, f"{key}.bin"), "wb").close()
    return fb.batch_exists_v2(ks, pools)


_dirs = itertools.count()


# ---------------------------------------------------------------- tests


def test_v2_interface_and_a_namespace_per_pool(sgl, daemon):
    cls, base = sgl.adapter.KVDriveHiCacheStorage, sgl.storage.HiCacheStorage
    for name in ("register_mem_host_pool_v2", "batch_exists_v2", "batch_get_v2", "batch_set_v2"):
        assert name in cls.__dict__, f"{name} is not implemented"
        ours, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(base, name))
        assert list(ours.parameters) == list(theirs.parameters), name

    kv, mamba, swa = kv_pool(sgl), MambaHostPool(), kv_pool(sgl)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa})
    state_bytes = mamba.get_size_per_token()
    assert state_bytes == 2 * (32 * 4 + 24 * 2 + 10 * 2)
    assert b.store.ns == "sglang/hybrid-model/default/b1024/tp0of1.page_first.bfloat16"  # KV: as without v2
    assert sorted(b.pools) == ["mamba", "swa"]  # the KV anchor registered through v2 is the anchor's store
    assert b.pools["mamba"].store.ns == \
        f"sglang/hybrid-model/default/b{state_bytes}/tp0of1.mamba.page_first.bfloat16+float32"
    assert b.pools["swa"].store.ns == "sglang/hybrid-model/default/b1024/tp0of1.swa.page_first.bfloat16"
    assert b.registered_pools[sgl.MAMBA] is mamba  # SGLang's base registry too
    assert b.pools["mamba"].regions and b.pools["swa"].regions

    flat = attach(sgl, daemon, kv, {sgl.MAMBA: MambaHostPool(side_state=True)})
    assert not flat.pools["mamba"].regions  # SGLang's Mamba pool has no page regions with side states
    assert flat.pools["mamba"].store.ns == \
        f"sglang/hybrid-model/default/b{state_bytes + 24}/tp0of1.mamba.page_first-flat.bfloat16+float32"

    # MLA: KV (and SWA) pages are one copy for every rank; Mamba state is each TP rank's own.
    mla = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa}, is_mla_model=True, tp_rank=1, tp_size=2)
    assert mla.store.ns.endswith("/mla.page_first.bfloat16")
    assert mla.pools["swa"].store.ns.endswith("/mla.swa.page_first.bfloat16")
    assert mla.pools["mamba"].store.ns.endswith("/tp1of2.mamba.page_first.bfloat16+float32")
    for made in (b, flat, mla):
        made.close()


def test_hybrid_backup_and_prefetch_round_trip_every_pool(sgl, daemon):
    """Two nodes of four pages backed up (KV pages, the Mamba state at each node's end, the
    SWA window before it), then the prefetch of the whole span into empty host pools."""
    torch = sgl.torch
    kv, mamba, swa = kv_pool(sgl, seed=1), MambaHostPool(seed=2), kv_pool(sgl, seed=3)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa})
    ks = keys(8, "round-trip")
    assert backup_node(sgl, b, ks[:4], [1, 3, 4, 7], mamba_slot=2, swa_pages=[5, 9]) == \
        {sgl.MAMBA: [True], sgl.SWA: [True, True], sgl.KV: [True] * 4}
    assert backup_node(sgl, b, ks[4:], [8, 10, 13, 15], mamba_slot=6, swa_pages=[11, 12]) == \
        {sgl.MAMBA: [True], sgl.SWA: [True, True], sgl.KV: [True] * 4}
    want_kv = [kv_page(sgl, kv, p) for p in [1, 3, 4, 7, 8, 10, 13, 15]]
    want_state = {3: mamba.state(2), 7: mamba.state(6)}
    want_swa = {2: kv_page(sgl, swa, 5), 3: kv_page(sgl, swa, 9), 6: kv_page(sgl, swa, 11), 7: kv_page(sgl, swa, 12)}
    assert b.pool_stats()["mamba"]["blocks_stored"] == 2 and b.pool_stats()["swa"]["blocks_stored"] == 4

    # A fresh engine (empty host pools) prefetches the span, as the controller does.
    kv2, mamba2, swa2 = kv_pool(sgl), MambaHostPool(), kv_pool(sgl)
    b2 = attach(sgl, daemon, kv2, {sgl.MAMBA: mamba2, sgl.SWA: swa2})
    query = [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["__placeholder__"]),
             transfer(sgl, sgl.SWA, sgl.TRAILING, ["__placeholder__"] * SWA_WINDOW)]
    hit = b2.batch_exists_v2(ks, query, sgl.storage.HiCacheStorageExtraInfo(prefix_keys=None))
    assert isinstance(hit, sgl.storage.PoolTransferResult)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (8, [4, 8])
    assert hit.extra_pool_hit_pages == {sgl.KV: 8, sgl.MAMBA: 8, sgl.SWA: 8}

    dst = [2, 5, 6, 9, 11, 12, 14, 16]
    assert b2.batch_get_v1(ks, tokens(sgl, dst)) == [True] * 8
    assert all(torch.equal(kv_page(sgl, kv2, p), w) for p, w in zip(dst, want_kv))
    # _sync_trailing_keys: the last N hashes of the hit; host slots / pages allocated for them.
    got = b2.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[7:8], slots(sgl, 9)),
                           transfer(sgl, sgl.SWA, sgl.TRAILING, ks[6:8], tokens(sgl, [20, 21]))])
    assert got == {sgl.MAMBA: [True], sgl.SWA: [True, True]}
    assert sgl.storage.count_pool_hits(got) == {"mamba": 1, "swa": 2}  # the controller's count, by pool.value
    assert torch.equal(mamba2.state(9), want_state[7])
    assert torch.equal(kv_page(sgl, swa2, 20), want_swa[6]) and torch.equal(kv_page(sgl, swa2, 21), want_swa[7])
    untouched = [s for s in range(MAMBA_SLOTS) if s != 9]
    assert all(not mamba2.state(s).any() for s in untouched)

    # The shorter stop point (4 pages) restores the first node's state and window.
    got = b2.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:4], slots(sgl, 0)),
                           transfer(sgl, sgl.SWA, sgl.TRAILING, ks[2:4], tokens(sgl, [0, 1]))])
    assert got == {sgl.MAMBA: [True], sgl.SWA: [True, True]}
    assert torch.equal(mamba2.state(0), want_state[3])
    assert torch.equal(kv_page(sgl, swa2, 0), want_swa[2]) and torch.equal(kv_page(sgl, swa2, 1), want_swa[3])

    # Pages are write-once: a backup again stores nothing new.
    assert backup_node(sgl, b, ks[4:], [8, 10, 13, 15], mamba_slot=6, swa_pages=[11, 12])[sgl.MAMBA] == [True]
    assert b.pool_stats()["mamba"]["blocks_stored"] == 2 and b.pool_stats()["mamba"]["stored_before"] == 1
    b.close()
    b2.close()


def test_pools_in_shared_memory_move_in_place_and_the_mamba_state_through_staging(sgl, daemon):
    torch = sgl.torch
    kv, mamba, swa = kv_pool(sgl, seed=4, shm=True), MambaHostPool(seed=5, shm=True), kv_pool(sgl, seed=6, shm=True)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa})
    assert b.store._shared is not None and b.pools["swa"].store._shared is not None
    # Its buffers are shared memory too, but its pages are not equal regions of one tensor.
    assert b.pools["mamba"].store._shared is None
    ks = keys(4, "in-place")
    assert backup_node(sgl, b, ks, [1, 3, 4, 7], mamba_slot=2, swa_pages=[5, 9]) == \
        {sgl.MAMBA: [True], sgl.SWA: [True, True], sgl.KV: [True] * 4}
    want_swa, want_state = [kv_page(sgl, swa, p) for p in (5, 9)], mamba.state(2)
    swa.kv_buffer.zero_()
    got = b.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:4], slots(sgl, 7)),
                          transfer(sgl, sgl.SWA, sgl.TRAILING, ks[2:4], tokens(sgl, [20, 21]))])
    assert got == {sgl.MAMBA: [True], sgl.SWA: [True, True]}
    assert torch.equal(kv_page(sgl, swa, 20), want_swa[0]) and torch.equal(kv_page(sgl, swa, 21), want_swa[1])
    assert torch.equal(mamba.state(7), want_state)
    st = b.pool_stats()
    assert st["swa"]["blocks_in_place"] == 4 and st["mamba"].get("blocks_in_place", 0) == 0
    assert b.stats()["blocks_in_place"] == 4
    b.close()


def test_flat_state_pages_round_trip(sgl, daemon):
    """A Mamba pool with slot side states reports no page regions (as SGLang's): its
    pages move as flat page tensors, byte for byte."""
    kv, mamba = kv_pool(sgl, seed=4), MambaHostPool(side_state=True, seed=5)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba})
    ks = keys(3, "flat")
    want = [mamba.state(s) for s in (1, 4, 7)]
    assert b.batch_set_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks, slots(sgl, 1, 4, 7))]) == \
        {sgl.MAMBA: [True] * 3}
    fresh = MambaHostPool(side_state=True)
    b2 = attach(sgl, daemon, kv_pool(sgl), {sgl.MAMBA: fresh})
    unknown = keys(1, "flat-unknown")
    got = b2.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, [ks[2], unknown[0], ks[0]], slots(sgl, 3, 5, 11))])
    assert got == {sgl.MAMBA: [True, False, True]}
    assert sgl.torch.equal(fresh.state(3), want[2]) and sgl.torch.equal(fresh.state(11), want[0])
    assert not fresh.state(5).any()  # a miss leaves its slot as it was
    b.close()
    b2.close()


def test_exists_follows_each_hit_policy_as_sglangs_file_backend(sgl, daemon, tmp_path):
    """``batch_exists_v2`` against SGLang's own file backend over the same stored pages:
    every pattern of KV, Mamba (TRAILING_PAGES, window 1), SWA (TRAILING_PAGES, window 2)
    and an indexer-like pool (ALL_PAGES) pages of a random sample."""
    kv, mamba, swa, indexer = kv_pool(sgl, seed=6), MambaHostPool(seed=7), kv_pool(sgl, seed=8), kv_pool(sgl, seed=9)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa, sgl.INDEXER: indexer})
    n = 6
    rng = random.Random(11)
    cases = [  # (pages present per pool), hand-picked, then random
        {sgl.KV: range(6), sgl.MAMBA: [5], sgl.SWA: [4, 5], sgl.INDEXER: range(6)},
        {sgl.KV: range(6), sgl.MAMBA: [1, 3], sgl.SWA: [0, 1, 2, 3], sgl.INDEXER: range(6)},  # stops 2, 4 only
        {sgl.KV: range(4), sgl.MAMBA: [5], sgl.SWA: [4, 5], sgl.INDEXER: range(6)},  # KV gap: nothing past 4
        {sgl.KV: range(6), sgl.MAMBA: [2, 5], sgl.SWA: [1, 2, 4, 5], sgl.INDEXER: range(3)},  # ALL_PAGES stops at 3
        {sgl.KV: [], sgl.MAMBA: [0], sgl.SWA: [0], sgl.INDEXER: [0]},
        {sgl.KV: range(6), sgl.MAMBA: [], sgl.SWA: range(6), sgl.INDEXER: range(6)},
    ]
    for _ in range(14):
        kv_prefix = rng.randint(0, n)
        cases.append({sgl.KV: range(kv_prefix) if rng.random() < 0.7 else rng.sample(range(n), rng.randint(0, n)),
                      **{name: rng.sample(range(n), rng.randint(0, n)) for name in (sgl.MAMBA, sgl.SWA, sgl.INDEXER)}})
    pools = [("mamba", 1), ("swa", SWA_WINDOW), ("indexer", 3)]
    seen = []
    for c, present in enumerate(cases):
        ks = keys(n, f"policy{c}-")
        kv_pages = sorted(present[sgl.KV])
        assert all(b.batch_set_v1([ks[i] for i in kv_pages], tokens(sgl, kv_pages)))
        for name, pages in present.items():
            if name == sgl.KV or not pages:
                continue
            pages = sorted(pages)
            host = slots(sgl, *pages) if name == sgl.MAMBA else tokens(sgl, pages)
            assert b.batch_set_v2([transfer(sgl, name, sgl.TRAILING, [ks[i] for i in pages], host)])[name] == \
                [True] * len(pages)
        for order in ([0, 1, 2], [2, 0, 1]):  # pools fold in the order the controller lists them
            query = []
            for j in order:
                name, window = pools[j]
                policy = sgl.ALL if name == "indexer" else sgl.TRAILING
                query.append(transfer(sgl, sgl.storage.PoolName(name), policy, ["__placeholder__"] * window))
            ours = b.batch_exists_v2(ks, query)
            theirs = reference_exists(sgl, tmp_path, ks, query, present)
            seen.append(theirs)
            assert (ours.kv_hit_pages, ours.extra_pool_hit_pages, ours.restorable_prefix_pages) == \
                (theirs.kv_hit_pages, theirs.extra_pool_hit_pages, theirs.restorable_prefix_pages), (c, order)
    # The sample has hits, misses of stored KV, and stop points with holes between them.
    assert sum(r.kv_hit_pages > 0 for r in seen) >= 8
    assert sum(r.kv_hit_pages == 0 and sgl.KV in r.extra_pool_hit_pages for r in seen) >= 4
    assert sum(r.restorable_prefix_pages not in ([], list(range(1, r.kv_hit_pages + 1))) for r in seen) >= 4
    # The hand-picked ones, spelled out.
    first = b.batch_exists_v2(keys(n, "policy1-"), [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"]),
                                                   transfer(sgl, sgl.SWA, sgl.TRAILING, ["x", "x"])])
    assert (first.kv_hit_pages, first.restorable_prefix_pages) == (4, [2, 4])
    assert first.extra_pool_hit_pages == {sgl.KV: 6, sgl.MAMBA: 4, sgl.SWA: 4}
    gap = b.batch_exists_v2(keys(n, "policy2-"), [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"])])
    assert (gap.kv_hit_pages, gap.extra_pool_hit_pages, gap.restorable_prefix_pages) == (0, {sgl.KV: 4}, [])
    all_pages = b.batch_exists_v2(keys(n, "policy3-"), [transfer(sgl, sgl.INDEXER, sgl.ALL, None)])
    assert (all_pages.kv_hit_pages, all_pages.extra_pool_hit_pages) == (3, {sgl.KV: 6, sgl.INDEXER: 3})
    assert b.batch_exists_v2(keys(n, "policy0-"), []).kv_hit_pages == 6  # no pools: the KV prefix
    b.close()


def test_block_groups_neither_gates_nor_gets_a_verdict(sgl, daemon, tmp_path):
    """SGLang 0.5.23 defines BLOCK_GROUPS only in the base class's words ("never gates the
    KV hit"); its own backends raise on it. Here it gets no verdict and gates nothing."""
    kv, indexer = kv_pool(sgl, seed=12), kv_pool(sgl)
    b = attach(sgl, daemon, kv, {sgl.INDEXER: indexer})
    ks = keys(4, "groups")
    assert all(b.batch_set_v1(ks, tokens(sgl, [0, 1, 2, 3])))
    groups = sgl.storage.PoolTransfer(name=sgl.INDEXER, keys=ks[:2], hit_policy=sgl.GROUPS, block_pages=2,
                                      group_pages=2)
    got = b.batch_exists_v2(ks, [groups, transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"])])  # Mamba: not registered
    assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (0, {sgl.KV: 4}, [])
    got = b.batch_exists_v2(ks, [groups])
    assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (4, {sgl.KV: 4}, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="Unsupported pool hit policy"):  # SGLang's file backend
        reference_exists(sgl, tmp_path, ks, [groups], {sgl.KV: range(4)})
    b.close()


def test_misses_and_failures_never_raise(sgl, daemon):
    torch = sgl.torch
    kv, mamba, swa = kv_pool(sgl, seed=13), MambaHostPool(seed=14), kv_pool(sgl, seed=15)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa}, extra={"retry_s": 0.3})
    ks, unknown = keys(4, "miss"), keys(2, "miss-unknown")
    before = mamba.state(3).clone()

    assert b.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, unknown[:1], slots(sgl, 3)),
                           transfer(sgl, sgl.SWA, sgl.TRAILING, unknown, tokens(sgl, [1, 2]))]) == \
        {sgl.MAMBA: [False], sgl.SWA: [False, False]}
    assert torch.equal(mamba.state(3), before)
    hit = b.batch_exists_v2(unknown, [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"])])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages, hit.restorable_prefix_pages) == (0, {}, [])

    # KV stored, its Mamba state not: no prefix is restorable.
    assert all(b.batch_set_v1(ks, tokens(sgl, [1, 2, 3, 4])))
    hit = b.batch_exists_v2(ks, [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"])])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages, hit.restorable_prefix_pages) == (0, {sgl.KV: 4}, [])

    # Host indices that are not one page per key, a pool never registered, no keys.
    assert b.batch_set_v2([transfer(sgl, sgl.SWA, sgl.TRAILING, ks[:2], tokens(sgl, [1]))]) == {sgl.SWA: [False] * 2}
    assert b.batch_set_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[:1], None)]) == {sgl.MAMBA: [False]}
    assert b.batch_get_v2([transfer(sgl, sgl.INDEXER, sgl.ALL, ks[:2], tokens(sgl, [1, 2]))]) == \
        {sgl.INDEXER: [False] * 2}
    assert b.batch_set_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, [], slots(sgl))]) == {sgl.MAMBA: []}
    assert b.batch_set_v2([]) == {} and b.batch_get_v2([]) == {}

    # A host pool that fails mid-call: that pool's pages are misses, the others' go on.
    class Broken(MambaHostPool):
        def get_page_buffer_meta(self, indices):
            if len(indices) == 1 and int(indices[0]) == 0:  # registration's probe
                return super().get_page_buffer_meta(indices)
            raise RuntimeError("host pool gone")

    b2 = attach(sgl, daemon, kv, {sgl.MAMBA: Broken(seed=16), sgl.SWA: swa})
    assert b2.batch_set_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[:1], slots(sgl, 5)),
                            transfer(sgl, sgl.SWA, sgl.TRAILING, ks[2:4], tokens(sgl, [7, 8]))]) == \
        {sgl.MAMBA: [False], sgl.SWA: [True, True]}

    # The daemon gone: misses within about a second, nothing raised.
    assert b.batch_set_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:4], slots(sgl, 3))])[sgl.MAMBA] == [True]
    daemon.kill9()
    t0 = time.monotonic()
    assert b.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:4], slots(sgl, 6))]) == {sgl.MAMBA: [False]}
    assert b.batch_set_v2([transfer(sgl, sgl.SWA, sgl.TRAILING, ks[:2], tokens(sgl, [9, 10]))]) == \
        {sgl.SWA: [False, False]}
    hit = b.batch_exists_v2(ks, [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"])])
    assert hit.kv_hit_pages == 0 and hit.restorable_prefix_pages == []
    b.clear()
    assert time.monotonic() - t0 < 5.0
    b.close()
    b2.close()


def test_clear_deletes_every_pools_pages(sgl, daemon):
    kv, mamba, swa = kv_pool(sgl, seed=17), MambaHostPool(seed=18), kv_pool(sgl, seed=19)
    b = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa})
    other = attach(sgl, daemon, kv, {sgl.MAMBA: mamba, sgl.SWA: swa}, extra={"tenant": "other"})
    ks = keys(4, "clear")
    query = [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"]), transfer(sgl, sgl.SWA, sgl.TRAILING, ["x", "x"])]
    for made in (b, other):
        backup_node(sgl, made, ks, [1, 2, 3, 4], mamba_slot=1, swa_pages=[5, 6])
        assert made.batch_exists_v2(ks, query).kv_hit_pages == 4
    before = daemon.client().stats()

    b.clear()
    assert b.batch_exists(ks) == 0 and b.batch_exists_v2(ks, query).kv_hit_pages == 0
    assert not any(b.pools["mamba"].store.lookup(ks[3:])) and not any(b.pools["swa"].store.lookup(ks[2:]))
    assert b.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:], slots(sgl, 8))]) == {sgl.MAMBA: [False]}
    assert b.stats()["blocks_deleted"] == 4
    assert {n: s["blocks_deleted"] for n, s in b.pool_stats().items()} == {"mamba": 1, "swa": 2}
    assert other.batch_exists_v2(ks, query).kv_hit_pages == 4  # another tenant's namespaces are kept
    after = daemon.client().stats()
    assert after["blocks"] == before["blocks"] - 7 and after["block_namespaces"] == before["block_namespaces"] - 3
    b.close()
    other.close()


def test_mla_ranks_share_kv_and_swa_but_each_keeps_its_mamba_state(sgl, daemon):
    """In an MLA model only the storage writer (TP rank 0) stores the pages every rank
    shares (KV, SWA); every rank stores its own Mamba state (the controller backs Mamba up
    on every rank), and clears only that."""
    kv, swa = kv_pool(sgl, seed=20), kv_pool(sgl, seed=21)
    m0, m1 = MambaHostPool(seed=22), MambaHostPool(seed=23)
    writer = attach(sgl, daemon, kv, {sgl.MAMBA: m0, sgl.SWA: swa}, is_mla_model=True, tp_rank=0, tp_size=2)
    replica = attach(sgl, daemon, kv, {sgl.MAMBA: m1, sgl.SWA: swa}, is_mla_model=True, tp_rank=1, tp_size=2)
    ks = keys(4, "mla")
    sidecars = [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:], slots(sgl, 2)),
                transfer(sgl, sgl.SWA, sgl.TRAILING, ks[2:], tokens(sgl, [3, 4]))]
    assert replica.batch_set_v2(sidecars) == {sgl.MAMBA: [True], sgl.SWA: [True, True]}
    assert replica.pool_stats()["mamba"]["blocks_stored"] == 1 and not replica.pool_stats()["swa"].get("blocks_stored")
    assert not any(writer.pools["swa"].store.lookup(ks[2:]))  # the replica wrote no shared page
    assert writer.batch_set_v2(sidecars) == {sgl.MAMBA: [True], sgl.SWA: [True, True]}
    assert all(writer.batch_set_v1(ks, tokens(sgl, [1, 2, 5, 6])))
    query = [transfer(sgl, sgl.MAMBA, sgl.TRAILING, ["x"]), transfer(sgl, sgl.SWA, sgl.TRAILING, ["x", "x"])]
    assert writer.batch_exists_v2(ks, query).kv_hit_pages == 4 and replica.batch_exists_v2(ks, query).kv_hit_pages == 4

    fresh = MambaHostPool()
    loader = attach(sgl, daemon, kv_pool(sgl), {sgl.MAMBA: fresh}, is_mla_model=True, tp_rank=1, tp_size=2)
    assert loader.batch_get_v2([transfer(sgl, sgl.MAMBA, sgl.TRAILING, ks[3:], slots(sgl, 0))]) == {sgl.MAMBA: [True]}
    assert sgl.torch.equal(fresh.state(0), m1.state(2))  # rank 1's own state, not rank 0's

    replica.clear()
    assert not any(replica.pools["mamba"].store.lookup(ks[3:]))
    assert writer.batch_exists_v2(ks, query).kv_hit_pages == 4  # the shared pages and rank 0's state are kept
    for made in (writer, replica, loader):
        made.close()
