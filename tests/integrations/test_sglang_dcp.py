"""KVDriveHiCacheStorage under SGLang's decode context parallelism (DCP): an MLA model whose
DCP ranks each hold their own share of every page's tokens (SGLang's MLA host pool with
``dcp_size`` > 1: ``page_size`` rows of each page, ``logical_page_size`` host indices a
page), driven as SGLang's cache controller drives a storage backend, against a real
kvstored. Two DCP ranks store the same page hashes and each loads back its own share byte
for byte, in namespaces of their own; the DCP ranks of another TP group load those shares
and store nothing, as SGLang's file backend keys and writes them; a host pool of other DCP
ranks than the storage config, and v2 pools SGLang keeps no pages of under DCP, are
refused.

The MLA pool is the CPU stand-in of :mod:`kvdrive.tools.engines`, checked first against
SGLang's own MLA pool methods under DCP, compiled from its installed source
(test_sglang_layouts)."""

from __future__ import annotations

import logging

import pytest

from kvdrive.tools.engines import MLAHostPool, PageFirstHostPool, ShmHostAllocator
from test_sglang import DST, PAGE, POOL_PAGES, SRC, keys, sgl, storage_config  # noqa: F401 - sgl: a fixture
from test_sglang_layouts import KV_LORA_RANK, LAYOUTS, MAX_REGIONS_IN_PLACE, QK_ROPE_HEAD_DIM, Case, as_bytes, fill, \
    sglang_pool
from test_sglang_v2 import MambaHostPool

DCP = 2  # DCP ranks of a TP group
ROWS = PAGE // DCP  # the rows of a page (PAGE host indices) each DCP rank holds
MLA_LAYOUTS = [c for c in LAYOUTS if c.mla]
PATHS = ["v1-shm", "v1", "flat"]  # interface_v1 in a memfd (in place), interface_v1, flat page tensors


def dcp_pool(sgl, case: Case, rank: int, seed: int | None = None, shm: bool = False, pages: int = POOL_PAGES,
             dcp_size: int = DCP) -> MLAHostPool:
    """DCP rank ``rank``'s MLA host pool of ``case`` (SGLang passes the widened page,
    ``PAGE`` host indices), zeros or random bytes; ``shm``: in a memfd."""
    pool = MLAHostPool(pages, PAGE, case.layers, KV_LORA_RANK, QK_ROPE_HEAD_DIM, sgl.torch.bfloat16,
                       ShmHostAllocator() if shm else None, case.layout, dcp_size=dcp_size, dcp_rank=rank)
    if seed is not None:
        fill(sgl, pool.kv_buffer, seed)
    return pool


def dcp_config(sgl, address, tp_rank: int, tp_size: int = DCP, interface_v1: bool = True, extra: dict | None = None):
    """SGLang's storage config of TP rank ``tp_rank`` of an MLA model under DCP, as its cache
    controller makes it (``_generate_storage_config``: the DCP rank, the controller's page
    as ``logical_page_size``)."""
    return storage_config(sgl, address, is_mla_model=True, tp_rank=tp_rank, tp_size=tp_size, dcp_size=DCP,
                          dcp_rank=tp_rank % DCP, logical_page_size=PAGE,
                          extra={"interface_v1": int(interface_v1), **(extra or {})})


def dcp_backend(sgl, daemon, pool, tp_rank: int, tp_size: int = DCP, interface_v1: bool = True, shm: bool = False):
    """The backend of TP rank ``tp_rank`` as SGLang's cache controller attaches it."""
    cfg = dcp_config(sgl, daemon.address, tp_rank, tp_size, interface_v1, {"allocator": "shm"} if shm else None)
    b = sgl.factory.StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def host_indices(sgl, pages):
    """The host indices of host pages as the controller passes them: ``PAGE`` (the pool's
    ``logical_page_size``) a page."""
    return sgl.torch.cat([sgl.torch.arange(p * PAGE, (p + 1) * PAGE, dtype=sgl.torch.int64) for p in pages])


def share(case: Case, pool, p: int):
    """Host page ``p``'s rows in the pool's tensor, this DCP rank's share of it (a view)."""
    buf, rows = pool.kv_buffer, slice(p * ROWS, (p + 1) * ROWS)
    if case.layout == "layer_first":
        return buf[:, rows]
    return buf[rows] if case.layout == "page_first" else buf[p: p + 1]


def regions(case: Case, pool, p: int) -> list:
    """Host page ``p``'s regions in SGLang's order: each layer's rows (``layer_first``), else
    the page's rows."""
    if case.layout == "layer_first":
        return [pool.kv_buffer[layer, p * ROWS:(p + 1) * ROWS] for layer in range(case.layers)]
    return [share(case, pool, p)]


def store(sgl, b, pool, ks, pages, path: str):
    """Back up host pages ``pages`` under ``ks`` as the controller does: ``batch_set_v1``, or
    (``flat``) ``batch_set`` of ``get_data_page(host_indices[i * page_size])``."""
    idx = host_indices(sgl, pages)
    if path == "flat":
        assert b.batch_set(ks, [pool.get_data_page(idx[i * PAGE]) for i in range(len(ks))]) is True
    else:
        assert b.batch_set_v1(ks, idx) == [True] * len(ks)


def load(sgl, b, pool, ks, pages, path: str):
    """Prefetch ``ks`` into host pages ``pages`` as the controller does: ``batch_get_v1``, or
    (``flat``) ``batch_get`` into the pool's dummy pages, then ``set_from_flat_data_page``."""
    idx = host_indices(sgl, pages)
    if path == "flat":
        got = b.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
        assert all(page is not None for page in got)
        for i, page in enumerate(got):
            pool.set_from_flat_data_page(idx[i * PAGE], page)
    else:
        assert b.batch_get_v1(ks, idx) == [True] * len(ks)


# ---------------------------------------------------------------- the stand-in is SGLang's pool under DCP


@pytest.mark.parametrize("rank", range(DCP))
@pytest.mark.parametrize("case", MLA_LAYOUTS, ids=str)
def test_the_stand_in_computes_what_sglangs_mla_pool_does_under_dcp(sgl, sglang_installed, case, rank):
    torch, pages = sgl.torch, 6
    theirs, ours = sglang_pool(sgl, sglang_installed, case, pages, DCP, rank), dcp_pool(sgl, case, rank, pages=pages)
    assert ours.kv_buffer.shape == theirs.kv_buffer.shape and ours.kv_buffer.dtype == theirs.kv_buffer.dtype
    assert (ours.page_size, ours.logical_page_size, ours.logical_size) == (ROWS, PAGE, pages * PAGE)
    assert ours.get_size_per_token() == theirs.get_size_per_token()
    for pool in (theirs, ours):
        fill(sgl, pool.kv_buffer, 21 + rank)
    idx = host_indices(sgl, (3, 0, 5))
    (their_ptrs, their_sizes), (our_ptrs, our_sizes) = theirs.get_page_buffer_meta(idx), ours.get_page_buffer_meta(idx)
    assert [p - theirs.kv_buffer.data_ptr() for p in their_ptrs] == [p - ours.kv_buffer.data_ptr() for p in our_ptrs]
    assert their_sizes == our_sizes and len(our_sizes) == 3 * case.regions
    # ... a page of PAGE host indices is this rank's ROWS rows of it, at row PAGE * p // DCP
    cut = [r for p in (3, 0, 5) for r in regions(case, ours, p)]
    assert our_ptrs == [r.data_ptr() for r in cut] and our_sizes == [r.nbytes for r in cut]
    assert sum(our_sizes[: case.regions]) == ours.get_size_per_token() * ROWS
    # The regions of page_size (ROWS) host indices are not a page: SGLang's pool asserts.
    with pytest.raises(AssertionError):
        theirs.get_page_buffer_meta(torch.arange(ROWS))
    with pytest.raises(ValueError, match="not whole pages of 4"):
        ours.get_page_buffer_meta(torch.arange(ROWS))
    for p in range(pages):
        assert torch.equal(as_bytes(sgl, ours.get_data_page(p * PAGE)), as_bytes(sgl, theirs.get_data_page(p * PAGE)))
        assert torch.equal(as_bytes(sgl, ours.page(p)), as_bytes(sgl, share(case, ours, p)))
    for pool in (theirs, ours):  # a page starts on a logical page boundary
        with pytest.raises(ValueError, match="logical page boundary"):
            pool.get_data_page(ROWS)
    dummy = ours.get_dummy_flat_data_page()
    assert dummy.shape == theirs.get_dummy_flat_data_page().shape and dummy.numel() == ROWS * case.layers * 576
    fill(sgl, dummy, 22)
    for pool in (theirs, ours):
        pool.set_from_flat_data_page(2 * PAGE, dummy.clone())
    assert torch.equal(as_bytes(sgl, ours.kv_buffer), as_bytes(sgl, theirs.kv_buffer))


# ---------------------------------------------------------------- each DCP rank's own share


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", MLA_LAYOUTS, ids=str)
def test_dcp_ranks_store_and_load_their_own_shares(sgl, daemon, case, path):
    """DCP ranks 0 and 1 (TP ranks 0 and 1, both storage writers) back up the same page
    hashes, each from its own pool; each then loads its own share back byte for byte into
    other host pages of its cleared pool, nothing else written."""
    torch, shm, flat = sgl.torch, path == "v1-shm", path == "flat"
    pools = [dcp_pool(sgl, case, r, seed=40 + 2 * MLA_LAYOUTS.index(case) + r, shm=shm) for r in range(DCP)]
    ranks = [dcp_backend(sgl, daemon, pools[r], tp_rank=r, interface_v1=not flat, shm=shm) for r in range(DCP)]
    assert all(b.writer for b in ranks)  # one storage writer per DCP rank
    page_bytes = pools[0].get_size_per_token() * ROWS
    assert all(b.store.block_bytes == page_bytes for b in ranks)

    ks = keys(len(SRC), f"dcp-{case}-{path}")
    stored = [[as_bytes(sgl, share(case, pool, p)).clone() for p in SRC] for pool in pools]
    assert not any(torch.equal(a, b) for a, b in zip(*stored))  # the ranks hold other bytes of each page
    for b, pool in zip(ranks, pools):
        assert b.batch_exists(ks) == 0
        store(sgl, b, pool, ks, SRC, path)
        assert b.batch_exists(ks) == len(ks)

    for b, pool, want in zip(ranks, pools, stored):
        pool.kv_buffer.zero_()
        load(sgl, b, pool, ks, DST, path)
        for i, p in enumerate(DST):
            assert torch.equal(as_bytes(sgl, share(case, pool, p)), want[i]), f"DCP rank {b.config.dcp_rank}, page {p}"
            share(case, pool, p).zero_()
        assert not pool.kv_buffer.view(torch.uint8).any()  # no byte outside the loaded pages written
        in_place = shm and case.regions <= MAX_REGIONS_IN_PLACE
        assert b.stats()["blocks_stored"] == b.stats()["blocks_loaded"] == len(ks)
        assert b.stats().get("blocks_in_place", 0) == (2 * len(ks) if in_place else 0)

    # Each share in a namespace of its own, as SGLang's file backend keys it (by DCP rank and TP size).
    layout = f"{case.layout}-flat" if flat else case.layout
    assert [b.store.ns for b in ranks] == [
        f"sglang/test-model/default/b{page_bytes}/mla-tp{DCP}-dcp{r}of{DCP}.{layout}.bfloat16" for r in range(DCP)]
    for b in ranks:
        b.close()


def test_another_tp_groups_dcp_ranks_load_the_first_groups_shares(sgl, daemon, tmp_path):
    """TP 4, DCP 2: TP ranks 0 and 1 (DCP ranks 0 and 1) store; ranks 2 and 3 hold the same
    DCP shares, store nothing, load the writers' shares. The ranks share namespaces as
    SGLang's own file backend shares its files. ``clear()`` deletes one share's pages."""
    torch, case = sgl.torch, MLA_LAYOUTS[0]
    pools = [dcp_pool(sgl, case, tp % DCP, seed=60 + tp if tp < DCP else None) for tp in range(2 * DCP)]
    ranks = [dcp_backend(sgl, daemon, pool, tp_rank=tp, tp_size=2 * DCP) for tp, pool in enumerate(pools)]
    assert [b.writer for b in ranks] == [True, True, False, False]
    files = [sgl.storage.HiCacheFile(dcp_config(sgl, "unused", tp, 2 * DCP), file_path=str(tmp_path / "hicache"))
             for tp in range(2 * DCP)]
    for a in range(2 * DCP):
        for b in range(2 * DCP):
            same_file = files[a]._get_suffixed_key("k") == files[b]._get_suffixed_key("k")
            assert (ranks[a].store.ns == ranks[b].store.ns) == same_file == (a % DCP == b % DCP)

    ks = keys(len(SRC), "dcp-groups")
    for b, pool in zip(ranks, pools):
        assert b.batch_set_v1(ks, host_indices(sgl, SRC)) == [True] * len(ks)  # the replicas: True, not stored
    assert [b.stats().get("blocks_stored", 0) for b in ranks] == [len(ks), len(ks), 0, 0]
    for tp in range(DCP, 2 * DCP):
        assert ranks[tp].batch_get_v1(ks, host_indices(sgl, DST)) == [True] * len(ks)
        for p_src, p_dst in zip(SRC, DST):
            assert torch.equal(as_bytes(sgl, share(case, pools[tp], p_dst)),
                               as_bytes(sgl, share(case, pools[tp - DCP], p_src)))

    ranks[DCP + 1].clear()  # not a storage writer: deletes nothing
    assert all(b.batch_exists(ks) == len(ks) for b in ranks)
    ranks[0].clear()  # DCP rank 0's shares only
    assert [b.batch_exists(ks) for b in ranks] == [0, len(ks), 0, len(ks)]
    for b in ranks:
        b.close()


# ---------------------------------------------------------------- what is refused


def test_a_host_pool_of_other_dcp_ranks_than_the_storage_config_is_refused(sgl, daemon):
    case = MLA_LAYOUTS[0]
    for pool, tp_rank in [(dcp_pool(sgl, case, 1), 0),  # DCP rank 1's pool, DCP rank 0's config
                          (dcp_pool(sgl, case, 0, dcp_size=1), 0),  # no DCP in the pool, DCP 2 in the config
                          (dcp_pool(sgl, case, 0, dcp_size=4), 0)]:  # DCP 4 in the pool
        with pytest.raises(ValueError, match="the storage config is DCP rank 0 of 2"):
            dcp_backend(sgl, daemon, pool, tp_rank=tp_rank)
    cfg = storage_config(sgl, daemon.address, is_mla_model=True)  # no DCP in the config, DCP 2 in the pool
    b = sgl.factory.StorageBackendFactory.create_backend("dynamic", cfg, None)
    with pytest.raises(ValueError, match="holds DCP rank 1 of 2"):
        b.register_mem_pool_host(dcp_pool(sgl, case, 1))
    b.close()


def test_v2_pools_under_dcp(sgl, daemon, caplog):
    """The KV pool through v2 moves each DCP rank's share; Mamba state is each TP rank's own
    (stored by every rank); any other pool (SWA here), which SGLang keeps no pages of under
    DCP, is refused: one log line, not stored, misses, no hit through it."""
    torch, case, st = sgl.torch, MLA_LAYOUTS[0], sgl.storage
    kv, swa, mamba = dcp_pool(sgl, case, 1, seed=70), PageFirstHostPool(POOL_PAGES, PAGE, 2, 2, 16), \
        MambaHostPool(seed=71)
    b = dcp_backend(sgl, daemon, kv, tp_rank=1)
    with caplog.at_level(logging.INFO, logger="kvdrive_client.integrations.sglang"):
        for name, pool in [(st.PoolName.KV, kv), (st.PoolName.MAMBA, mamba), (st.PoolName.SWA, swa)]:
            b.register_mem_host_pool_v2(pool, name)
    refused = [r for r in caplog.records if "host pool swa under decode context parallelism" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.ERROR
    assert sorted(b.pools) == ["mamba"]
    assert b.pools["mamba"].store.ns.endswith(f"/tp1of{DCP}-dcp1of{DCP}.mamba.page_first.bfloat16+float32")
    assert b.writer  # Mamba state is stored by every rank anyway

    ks = keys(3, "dcp-v2")
    kv_pages = [2, 5, 7]
    want = [as_bytes(sgl, share(case, kv, p)).clone() for p in kv_pages]
    want_state = mamba.state(4)
    caplog.clear()
    done = b.batch_set_v2([
        st.PoolTransfer(name=st.PoolName.KV, host_indices=host_indices(sgl, kv_pages), keys=ks),
        st.PoolTransfer(name=st.PoolName.MAMBA, host_indices=torch.tensor([4]), keys=ks[-1:],
                        hit_policy=st.PoolHitPolicy.TRAILING_PAGES),
        st.PoolTransfer(name=st.PoolName.SWA, host_indices=host_indices(sgl, kv_pages), keys=ks,
                        hit_policy=st.PoolHitPolicy.TRAILING_PAGES)])
    assert done == {st.PoolName.KV: [True] * 3, st.PoolName.MAMBA: [True], st.PoolName.SWA: [False] * 3}
    assert not caplog.records  # refused once, at registration

    kv.kv_buffer.zero_()
    mamba.temporal_buffer.zero_()
    got = b.batch_get_v2([
        st.PoolTransfer(name=st.PoolName.KV, host_indices=host_indices(sgl, [9, 10, 11]), keys=ks),
        st.PoolTransfer(name=st.PoolName.MAMBA, host_indices=torch.tensor([6]), keys=ks[-1:]),
        st.PoolTransfer(name=st.PoolName.SWA, host_indices=host_indices(sgl, [9, 10, 11]), keys=ks)])
    assert got == {st.PoolName.KV: [True] * 3, st.PoolName.MAMBA: [True], st.PoolName.SWA: [False] * 3}
    for w, p in zip(want, [9, 10, 11]):
        assert torch.equal(as_bytes(sgl, share(case, kv, p)), w)
    assert torch.equal(mamba.state(6), want_state)

    mamba_only = b.batch_exists_v2(ks, [st.PoolTransfer(name=st.PoolName.MAMBA, keys=ks[-1:],
                                                        hit_policy=st.PoolHitPolicy.TRAILING_PAGES)])
    assert mamba_only.kv_hit_pages == 3
    with_swa = b.batch_exists_v2(ks, [st.PoolTransfer(name=st.PoolName.SWA, keys=ks[-2:],
                                                      hit_policy=st.PoolHitPolicy.TRAILING_PAGES)])
    assert with_swa.kv_hit_pages == 0 and not with_swa.restorable_prefix_pages
    assert not caplog.records
    b.close()
