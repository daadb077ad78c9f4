"""KVDriveHiCacheStorage on host pools of each layout SGLang's MHA and MLA host pools take,
driven as SGLang's cache controller drives a zero-copy backend (``batch_set_v1`` /
``batch_get_v1``), against a real kvstored: every page loads back byte for byte into other
host pages, nothing else in the pool is written, and a page is stored as its regions in
SGLang's order; in place where the pool is in shared memory and a page lies in at most
``MAX_REGIONS_IN_PLACE`` regions, through staging elsewhere.

The pools are the CPU stand-ins of :mod:`kvdrive.tools.engines` (SGLang's own need a GPU
device pool to be built), checked first against SGLang's own methods, compiled from its
installed source (its pool modules import much of its server), and against the pages and
regions these tests cut out of the pool's tensor themselves."""

from __future__ import annotations

import ast
import collections
from dataclasses import dataclass

import numpy as np
import pytest

from kvdrive.tools.engines import MHAHostPool, MLAHostPool, ShmHostAllocator
from test_sglang import DST, PAGE, POOL_PAGES, SRC, backend, host_indices, keys, sgl  # noqa: F401 - sgl: a fixture

HEADS, HEAD_DIM = 2, 16  # MHA: K and V of a token and layer, bf16: 64 bytes each
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64  # MLA: a token and layer, bf16: 1152 bytes
MAX_REGIONS_IN_PLACE = 8  # the backend's (asserted below)


@dataclass(frozen=True)
class Case:
    """A host pool: MHA or MLA, its layout and layers, and the regions of each page."""

    kind: str
    layout: str
    layers: int
    regions: int

    def __str__(self) -> str:
        return f"{self.kind}-{self.layout}-{self.layers}layers"

    @property
    def mla(self) -> bool:
        return self.kind == "mla"


CASES = [
    Case("mha", "page_first", 3, 2),
    Case("mha", "page_first_direct", 3, 2),
    Case("mha", "page_head", 3, 2),
    Case("mha", "layer_first", 4, 8),  # K and V of each layer: in place
    Case("mha", "layer_first", 5, 10),  # past MAX_REGIONS_IN_PLACE: through staging
    Case("mla", "page_first", 3, 1),
    Case("mla", "page_first_direct", 3, 1),
    Case("mla", "layer_first", 3, 3),  # one region a layer: in place
    Case("mla", "layer_first", 9, 9),  # through staging
]
LAYOUTS = [c for c in CASES if c.regions <= MAX_REGIONS_IN_PLACE]  # each layout once


def make_pool(sgl, case: Case, seed: int | None = None, shm: bool = False, pages: int = POOL_PAGES):
    """The stand-in host pool of ``case``, zeros or random bytes; ``shm``: in a memfd, made by
    SGLang's own ``shm`` host allocator."""
    allocator = ShmHostAllocator() if shm else None
    if case.mla:
        pool = MLAHostPool(pages, PAGE, case.layers, KV_LORA_RANK, QK_ROPE_HEAD_DIM, sgl.torch.bfloat16, allocator,
                           case.layout)
    else:
        pool = MHAHostPool(pages, PAGE, case.layers, HEADS, HEAD_DIM, sgl.torch.bfloat16, allocator, case.layout)
    if seed is not None:
        fill(sgl, pool.kv_buffer, seed)
    return pool


def fill(sgl, tensor, seed: int) -> None:
    raw = tensor.view(sgl.torch.uint8)
    raw.copy_(sgl.torch.randint(0, 256, raw.shape, dtype=sgl.torch.uint8,
                                generator=sgl.torch.Generator().manual_seed(seed)))


def data_page(case: Case, pool, p: int):
    """Host page ``p`` cut out of the pool's tensor as SGLang's layout lays it (a view)."""
    buf, t = pool.kv_buffer, slice(p * PAGE, (p + 1) * PAGE)
    if case.layout == "layer_first":
        return buf[:, t] if case.mla else buf[:, :, t]  # [layers, tokens, ...] / [2, layers, tokens, ...]
    if case.layout == "page_first":
        return buf[t] if case.mla else buf[:, t]
    return buf[p: p + 1] if case.mla else buf[:, p: p + 1]  # page_first_direct, page_head: a page a row


def regions(case: Case, pool, p: int) -> list:
    """Host page ``p``'s regions in the pool's tensor, in the order SGLang's
    ``get_page_buffer_meta`` reports them (views): K and V of each layer (MHA
    ``layer_first``), each layer's (MLA ``layer_first``), K and V (MHA), the page (MLA)."""
    buf, t = pool.kv_buffer, slice(p * PAGE, (p + 1) * PAGE)
    if case.layout == "layer_first":
        if case.mla:
            return [buf[layer, t] for layer in range(case.layers)]
        return [buf[kv, layer, t] for layer in range(case.layers) for kv in (0, 1)]
    at = t if case.layout == "page_first" else p
    return [buf[at]] if case.mla else [buf[0, at], buf[1, at]]


def as_bytes(sgl, t):
    return t.contiguous().view(sgl.torch.uint8).reshape(-1)


# ---------------------------------------------------------------- the stand-ins are SGLang's pools


def sglang_methods(root, module: str, cls: str, names: list[str], env: dict) -> dict:
    """Methods ``names`` of class ``cls`` of SGLang's ``pool_host/<module>``, compiled from the
    installed source in a namespace of ``env`` alone (their module imports much of SGLang's
    server, which these tests do not install)."""
    path = root / "sglang" / "srt" / "mem_cache" / "pool_host" / module
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    defs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(d.name for d in defs) == sorted(names), f"{cls} in {path} changed"
    ns = dict(env)
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102 - SGLang's own code
    return {name: ns[name] for name in names}


def sglang_pool(sgl, root, case: Case, pages: int, dcp_size: int = 1, dcp_rank: int = 0):
    """An object with SGLang's own host pool methods for ``case`` and the attributes its
    ``__init__`` sets (one device; MLA: DCP rank ``dcp_rank`` of ``dcp_size``, a page of
    ``PAGE`` host indices, ``PAGE // dcp_size`` rows), its ``kv_buffer`` made by its own
    ``init_kv_buffer``."""
    torch = sgl.torch

    def alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return torch.zeros(dims, dtype=dtype)

    env = {"torch": torch, "ALLOC_MEMORY_FUNCS": collections.defaultdict(lambda: alloc)}
    names = ["init_kv_buffer", "get_size_per_token", "get_page_buffer_meta", "get_data_page",
             "get_dummy_flat_data_page", "set_from_flat_data_page"]
    rows = PAGE // dcp_size  # HostKVCache.__init__: page_size arrives widened, x dcp_size
    attrs = dict(layout=case.layout, layer_num=case.layers, dtype=torch.bfloat16, page_size=rows, page_num=pages,
                 size=pages * rows, device="cpu", pin_memory=False, allocator=None,
                 _transfer_device=torch.device("cpu"))
    if case.mla:
        methods = sglang_methods(root, "mla.py", "MLATokenToKVPoolHost", [*names, "_storage_page_index"], env)
        kv_cache_dim = KV_LORA_RANK + QK_ROPE_HEAD_DIM
        attrs.update(kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, kv_cache_dim=kv_cache_dim,
                     dcp_size=dcp_size, dcp_rank=dcp_rank, logical_page_size=PAGE, logical_size=pages * PAGE,
                     _size_per_token=kv_cache_dim * torch.bfloat16.itemsize * case.layers)
    else:
        assert dcp_size == 1, "DCP is MLA only"
        methods = sglang_methods(root, "mha.py", "MHATokenToKVPoolHost", names, env)
        attrs.update(head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM)
    pool = type(f"SGLang{case.kind.upper()}HostPool", (), methods)()
    vars(pool).update(attrs)
    pool.kv_buffer = pool.init_kv_buffer()
    return pool


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
def test_the_stand_in_computes_what_sglangs_host_pool_does(sgl, sglang_installed, case):
    torch, pages = sgl.torch, 6
    theirs, ours = sglang_pool(sgl, sglang_installed, case, pages), make_pool(sgl, case, pages=pages)
    assert ours.kv_buffer.shape == theirs.kv_buffer.shape and ours.kv_buffer.dtype == theirs.kv_buffer.dtype
    assert ours.get_size_per_token() == theirs.get_size_per_token()
    for pool in (theirs, ours):
        fill(sgl, pool.kv_buffer, 11)
    idx = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (3, 0, 5)])
    (their_ptrs, their_sizes), (our_ptrs, our_sizes) = theirs.get_page_buffer_meta(idx), ours.get_page_buffer_meta(idx)
    assert [p - theirs.kv_buffer.data_ptr() for p in their_ptrs] == [p - ours.kv_buffer.data_ptr() for p in our_ptrs]
    assert their_sizes == our_sizes and len(our_sizes) == 3 * case.regions
    # ... which are the regions these tests cut out of the pool, K and V apart, in SGLang's order
    cut = [r for p in (3, 0, 5) for r in regions(case, ours, p)]
    assert our_ptrs == [r.data_ptr() for r in cut] and our_sizes == [r.nbytes for r in cut]
    assert all(r.is_contiguous() for r in cut)
    assert sum(our_sizes[: case.regions]) == ours.get_size_per_token() * PAGE
    for p in range(pages):
        assert torch.equal(as_bytes(sgl, ours.get_data_page(p * PAGE)), as_bytes(sgl, theirs.get_data_page(p * PAGE)))
        assert torch.equal(as_bytes(sgl, ours.page(p)), as_bytes(sgl, data_page(case, ours, p)))
        assert ours.page(p).shape == theirs.get_data_page(p * PAGE, flat=False).shape
    dummy = ours.get_dummy_flat_data_page()
    assert dummy.shape == theirs.get_dummy_flat_data_page().shape and dummy.dtype == torch.bfloat16
    fill(sgl, dummy, 12)
    for pool in (theirs, ours):
        pool.set_from_flat_data_page(2 * PAGE, dummy.clone())
    assert torch.equal(as_bytes(sgl, ours.kv_buffer), as_bytes(sgl, theirs.kv_buffer))


# ---------------------------------------------------------------- the backend on each layout


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "plain"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pages_of_each_layout_round_trip_byte_for_byte(sgl, daemon, case, shm):
    """Stored from one set of host pages, loaded into others after the pool was cleared:
    each byte back in its place per SGLang's layout, nothing else written; in place where
    the pool is shared memory and a page is at most MAX_REGIONS_IN_PLACE regions."""
    torch = sgl.torch
    assert sgl.adapter.MAX_REGIONS_IN_PLACE == MAX_REGIONS_IN_PLACE
    pool = make_pool(sgl, case, seed=2 * CASES.index(case) + shm, shm=shm)
    b = backend(sgl, daemon, pool, is_mla_model=case.mla, extra={"allocator": "shm"} if shm else {})
    page_bytes = pool.get_size_per_token() * PAGE
    in_place = shm and case.regions <= MAX_REGIONS_IN_PLACE
    shard = "mla" if case.mla else "tp0of1"
    assert b.store.ns == f"sglang/test-model/default/b{page_bytes}/{shard}.{case.layout}.bfloat16"
    assert b.store.regions == (case.regions if case.regions <= MAX_REGIONS_IN_PLACE else 1)
    assert (b.store._shared is not None) == in_place

    ks = keys(len(SRC), str(case))
    assert b.batch_exists(ks) == 0
    assert b.batch_set_v1(ks, host_indices(sgl, SRC)) == [True] * len(SRC)
    assert b.batch_exists(ks) == len(SRC)
    stored = [as_bytes(sgl, data_page(case, pool, p)).clone() for p in SRC]
    blocks = [torch.cat([as_bytes(sgl, r) for r in regions(case, pool, p)]).numpy().copy() for p in SRC]
    assert not any(np.array_equal(blocks[0], other) for other in blocks[1:])

    pool.kv_buffer.zero_()
    assert b.batch_get_v1(ks, host_indices(sgl, DST)) == [True] * len(DST)
    for want, p in zip(stored, DST):
        assert torch.equal(as_bytes(sgl, data_page(case, pool, p)), want), f"host page {p}"
        data_page(case, pool, p).zero_()
    assert not pool.kv_buffer.view(torch.uint8).any()  # no byte outside the loaded pages written

    st = b.stats()
    assert st["blocks_stored"] == st["blocks_loaded"] == len(SRC)
    assert st.get("blocks_in_place", 0) == (2 * len(SRC) if in_place else 0)
    # Stored as SGLang's regions of each page, in order, however they moved: a flat copy.
    flat = [np.zeros(page_bytes, np.uint8) for _ in ks]
    assert b.store.load(ks, flat) == [True] * len(ks)
    for got, want in zip(flat, blocks):
        assert np.array_equal(got, want)

    # A pool of the other memory kind (in place <-> staging) loads the same pages.
    other_pool = make_pool(sgl, case, shm=not shm)
    other = backend(sgl, daemon, other_pool, is_mla_model=case.mla, extra={"allocator": "shm"} if not shm else {})
    assert other.store.ns == b.store.ns
    assert other.batch_get_v1(ks[::-1], host_indices(sgl, SRC)) == [True] * len(SRC)
    for want, p in zip(stored[::-1], SRC):
        assert torch.equal(as_bytes(sgl, data_page(case, other_pool, p)), want), f"host page {p}"
    other_in_place = not shm and case.regions <= MAX_REGIONS_IN_PLACE
    assert other.stats().get("blocks_in_place", 0) == (len(SRC) if other_in_place else 0)
    b.close()
    other.close()
