"""What only the compiled CPU kernels have: calls split across threads, reused scratch,
argument checks, and the torch threading context a decode step runs under."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvdrive.kernels import cpu, for_device
from kvdrive.kernels.cpu import attention, lowrank, threads as cpu_threads
from kvdrive.kernels import reference as ref
from kvdrive.kernels.backends import Kernels
from kvdrive_client.selectors import IndexKind, make_selector

from kernel_cases import EMPTY_ROW, FEW_SELECTABLE_ROW, NONE_SELECTABLE_ROW, lowrank_case, random_slots


@pytest.fixture
def threads():
    """Set torch's intra-op thread count inside a test; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [3, 1])
def test_sparse_attention_split_across_threads_matches_one_call(monkeypatch, threads, rows):
    """Rows (or, for one row, heads) attended on several threads give exactly the one-thread result."""
    g = torch.Generator().manual_seed(rows)
    B, H, G, D, C, S, K, L = rows, 2, 4, 32, 24, 8, 10, 5
    kc, vc = (torch.randn(B, H, C, S, D, generator=g).half() for _ in range(2))
    lk, lv = (torch.randn(B, H, L, D, generator=g).half() for _ in range(2))
    slots = random_slots(g, B, H, K, C)
    slots[0, 0, 3] = -1
    query = torch.randn(B, H, G, D, generator=g)
    valid = torch.rand(B, H, K * S + L, generator=g) > 0.2
    threads(1)
    one = cpu.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    threads(2)
    parts = []
    kernel = attention._sparse_attention  # replaced where sparse_attention looks them up
    monkeypatch.setattr(attention, "_sparse_attention", lambda *a: parts.append(a[0].shape[:2]) or kernel(*a))
    monkeypatch.setattr(attention, "_ATTENTION_PART_MIN_WORK", 1)
    split = cpu.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17)
    assert len(parts) == 2 and all(p != query.shape[:2] for p in parts)
    assert torch.equal(one, split)


@pytest.mark.parametrize("rows", [2, 1])
def test_lowrank_split_across_threads_matches_one_call(monkeypatch, threads, rows):
    """Rows (or, for one row, heads) scored on several threads give exactly the one-thread result."""
    c = lowrank_case(1).rows(rows)
    g = torch.Generator().manual_seed(7)
    selectable = torch.rand(rows, c.num_pages, generator=g) > 0.3
    cached = torch.randint(-1, c.num_pages, (rows, c.codes.shape[1], 5), generator=g)

    def both():
        return (cpu.lowrank_scores(c.query, c.qproj, c.scale, c.scaling, c.codes, c.valid, c.num_pages, c.page_size,
                                   c.layout),
                *cpu.lowrank_select(c.query, c.qproj, c.scale, c.scaling, c.codes, c.valid, selectable, 6, c.page_size,
                                    cached, c.layout))

    threads(1)
    one = both()
    threads(3)
    monkeypatch.setattr(cpu_threads, "_PART_MIN_WORK", 1)  # split however small the call
    parts = []
    for name in ("_lowrank_scores_fused", "_lowrank_select_fused", "_lowrank_scores_passes", "_lowrank_select_passes"):
        kernel = getattr(lowrank, name)
        monkeypatch.setattr(lowrank, name, lambda *a, kernel=kernel: parts.append(a[0].shape[:2]) or kernel(*a))
    split = both()
    # Two calls, each in as many parts as threads (at most one per row, or per head of a single row).
    n = min(3, rows if rows > 1 else c.codes.shape[1])
    assert len(parts) == 2 * n and all(p != c.query.shape[:2] for p in parts)
    for a, b in zip(one, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [4, 0])  # the fused logit pass, and the passes of other layouts
def test_lowrank_scratch_left_from_an_earlier_call_never_reaches_a_result(threads, seed):
    """The low-rank kernels keep their scratch between calls: poisoned with NaN, the next
    call's results are the same as with fresh scratch."""
    c = lowrank_case(seed)
    selectable = torch.rand(c.codes.shape[0], c.num_pages, generator=torch.Generator().manual_seed(seed)) > 0.3
    cached = torch.tensor([[[3, -1, 7]] * c.codes.shape[1]] * c.codes.shape[0])

    def both():
        return (cpu.lowrank_scores(c.query, c.qproj, c.scale, c.scaling, c.codes, c.valid, c.num_pages, c.page_size,
                                   c.layout),
                *cpu.lowrank_select(c.query, c.qproj, c.scale, c.scaling, c.codes, c.valid, selectable, 6, c.page_size,
                                    cached, c.layout))

    threads(1)  # one part: the scratch is this thread's
    fresh = both()
    scratch = cpu._work.lowrank
    for buf in scratch:
        buf[...] = np.nan
    again = both()
    assert cpu._work.lowrank is scratch  # the poisoned scratch was the one used
    for a, b in zip(fresh, again):
        assert torch.equal(a, b)


def _as_index(case):
    """What :func:`cpu.lowrank_choose` reads of a low-rank index, for a kernel case."""
    return SimpleNamespace(qproj=case.qproj, scale=case.scale, scaling=case.scaling, codes=case.codes, valid=case.valid,
                           page_size=case.page_size, layout=case.layout)


@pytest.mark.parametrize("k", [7, 0, 45])  # 45: more than the 40 pages
@pytest.mark.parametrize("seed", [4, 0, 9])  # the fused logit pass, and the passes of other layouts
def test_lowrank_choose_is_the_select_with_the_sink_before_and_unscored_pages_as_none(seed, k):
    """One compiled call gives exactly what the torch composition of :func:`cpu.lowrank_select` gives
    (Kernels.lowrank_choose): sink pages first, -1 for picks without a score (rows with fewer
    selectable pages than k, rows with nothing valid), and the same cached pages' scores."""
    c = lowrank_case(seed)
    b, h = c.codes.shape[:2]
    g = torch.Generator().manual_seed(seed)
    selectable = torch.rand(b, c.num_pages, generator=g) > 0.3
    selectable[FEW_SELECTABLE_ROW] = False
    selectable[FEW_SELECTABLE_ROW, [5, 17, 30]] = True
    selectable[NONE_SELECTABLE_ROW] = False
    sink = torch.tensor([[0, 1], [3, -1], [0, 1], [0, 1]])
    cpu_kernels = for_device("cpu", "cpu")
    for cached in (torch.randint(-1, c.num_pages + 2, (b, h, 5), generator=g), None):
        expect = Kernels.lowrank_choose(cpu_kernels, c.query, _as_index(c), selectable, k, sink, cached)
        got = cpu.lowrank_choose(c.query, _as_index(c), selectable, k, sink, cached)
        assert torch.equal(got[0], expect[0]) and got[0].dtype == torch.int64
        assert (got[1] is None) == (cached is None) and (cached is None or torch.equal(got[1], expect[1]))
        if k:
            assert (got[0][NONE_SELECTABLE_ROW, :, 2:] == -1).all() and (got[0][EMPTY_ROW, :, 2:] == -1).all()
            assert (got[0][FEW_SELECTABLE_ROW, :, 5:] == -1).all() and (got[0][FEW_SELECTABLE_ROW, :, 2:5] >= 0).all()


def test_lowrank_choose_follows_an_index_through_pages_added_in_place_and_growth():
    """The index's arrays are viewed once and kept: a page added in place shows through them, and an
    index that grew (new tensors) or a view of some of its rows is viewed afresh."""
    g = torch.Generator().manual_seed(3)
    b, h, d, s = 2, 2, 64, 16
    index = make_selector(IndexKind.LOWRANK, s, 0.125, kernels=for_device("cpu", "cpu"))
    index.build(torch.randn(b, h, 20 * s, d, generator=g), torch.ones(b, 20 * s, dtype=torch.bool))
    sink = torch.zeros(b, 1, dtype=torch.int64)

    def check(index, query):
        selectable = torch.ones(query.shape[0], index.num_pages, dtype=torch.bool)
        got, _ = index.choose(query, selectable, 4, sink[: query.shape[0]], None)
        fresh = Kernels.lowrank_choose(index.kernels(query), query, index, selectable, 4, sink[: query.shape[0]], None)
        assert torch.equal(got, fresh[0])
        return got

    codes = index.codes
    for step in range(80):  # past the spare capacity: the index grows once
        query = torch.randn(b, h, 3, d, generator=g)
        chosen = check(index, query)
        keys = query[:, :, :1].expand(b, h, s, d) * 4  # a page the next query heads favour
        index.add_page(keys.contiguous(), torch.ones(b, s, dtype=torch.bool))
        if step % 7 == 0:
            check(index.rows(1, 2), query[1:])
    assert index.codes is not codes  # it grew
    assert chosen.shape == (b, h, 5)


def test_sparse_attention_refuses_a_short_valid_mask():
    kc = torch.zeros(1, 1, 4, 8, 16)
    with pytest.raises(ValueError, match="valid covers"):
        cpu.sparse_attention(torch.zeros(1, 1, 2, 16), kc, kc, torch.zeros(1, 1, 3, dtype=torch.long), kc[:, :, 0, :2],
                             kc[:, :, 0, :2], torch.ones(1, 1, 20, dtype=torch.bool), 1.0)


def test_one_torch_thread_keeps_the_kernels_threads(threads):
    """Inside, torch ops run on one thread while the kernels still split across the caller's threads;
    after, both are restored."""
    threads(3)
    with cpu.one_torch_thread():
        assert torch.get_num_threads() == 1
        assert cpu.kernel_threads() == 3
        with cpu.one_torch_thread():  # nested: no change
            assert torch.get_num_threads() == 1 and cpu.kernel_threads() == 3
        assert cpu.kernel_threads() == 3
    assert torch.get_num_threads() == 3 and cpu.kernel_threads() == 3
    threads(1)
    with cpu.one_torch_thread():
        assert torch.get_num_threads() == 1 and cpu.kernel_threads() == 1


def test_fetched_pages_reach_a_cuda_device_through_pinned_staging_and_a_copy_stream():
    """Choosing kernels for a CUDA device needs no CUDA context; the copy path is CUDA's own."""
    from kvdrive.kernels import for_device
    from kvdrive.kernels.transfer import CudaTransfer, HostTransfer

    assert type(for_device("cpu").transfer) is HostTransfer
    assert type(for_device("cpu", "reference").transfer) is HostTransfer
    assert isinstance(for_device("cuda").transfer, CudaTransfer)
    host = torch.arange(6.0)
    assert for_device("cpu").transfer.to_device(host, 0) is host  # read in place on the CPU


@pytest.mark.gpu
def test_cuda_transfer_copies_from_a_pinned_shared_buffer():
    from kvdrive.kernels.transfer import CudaTransfer

    t = CudaTransfer(torch.device("cuda"))
    array = np.zeros(1 << 20, dtype=np.uint8)
    array[:8] = np.arange(8)
    t.register(array)
    out = t.to_device(torch.from_numpy(array[:8]), slot=0)
    t.before_reuse(0)
    assert out.device.type == "cuda" and out.cpu().tolist() == list(range(8))
    t.unregister(array)


def _numpy_lowrank_scores(query, qproj, scale, scaling, values, valid, page_size):
    """The low-rank page scores in float64 numpy: each query head's logits over every valid token,
    softmax, summed per page and over the query heads, log."""
    w = np.einsum("bhgd,bhdr->bhgr", query.astype(np.float64), qproj.astype(np.float64)) * scale[:, :, None] * scaling
    logits = np.einsum("bhgr,bhrt->bhgt", w, values.astype(np.float64))
    logits = np.where(valid[:, None, None, :], logits, -np.inf)
    top = logits.max(axis=3, keepdims=True)
    mass = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
    mass = mass / np.maximum(mass.sum(axis=3, keepdims=True), 1e-300)
    b, h, g, t = mass.shape
    pages = mass.reshape(b, h, g, t // page_size, page_size).sum(axis=(2, 4))
    with np.errstate(divide="ignore"):
        return np.log(pages), w


# Gemma 3's default layout (head dim 256), head dim 128's, and odd ones: int4 rows with one channel, int2 rows short.
@pytest.mark.parametrize("shape, page_size", [((108, 4, 52, 4), 16), ((54, 2, 24, 4), 16), ((14, 2, 7, 3), 24),
                                              ((9, 1, 3, 5), 16), ((6, 0, 6, 2), 40)])
@pytest.mark.parametrize("by_vnni", [False, True], ids=["int16", "vnni"])
def test_lowrank_scores_match_a_numpy_reference_within_the_rounded_weights_bound(monkeypatch, shape, page_size,
                                                                                  by_vnni):
    """Layouts other than the fused one score their int4 and int2 channels with rounded weights:
    int16 ones in the passes, or int8 ones in VNNI dot products where the host has them (the
    other path forced by ``KVDRIVE_LOWRANK_VNNI=0``). On random inputs over more than one tile
    of tokens the page scores stay within the bound that rounding allows, against float64
    numpy (pages of 16 tokens, and of sizes a tile holds no whole number of)."""
    if by_vnni and not lowrank.vnni_available():
        pytest.skip("no AVX-512 VNNI and VBMI on this host")
    monkeypatch.setenv(lowrank.VNNI_ENV, "1" if by_vnni else "0")
    assert lowrank.vnni() == by_vnni
    rng = np.random.default_rng(sum(shape))
    R, wide, narrow, G = shape
    layout = ref.SketchLayout(R, wide, narrow)
    B, H, D, S = 2, 2, 48, page_size
    P = 2 * cpu._PASS_TILE // S + 5
    levels = layout.levels().numpy().astype(np.int64)[None, None, :, None]
    values = rng.integers(-levels, np.where(levels == 127, 128, levels), (B, H, R, P * S)).astype(np.int8)
    query = rng.standard_normal((B, H, G, D)).astype(np.float32)
    qproj = (rng.standard_normal((B, H, D, R)) * 0.3).astype(np.float16)
    scale = (rng.random((B, H, R)) * 0.05 + 1e-3).astype(np.float32)
    valid = rng.random((B, P * S)) > 0.1
    valid[1, : 3 * S] = False
    scaling = 0.2
    codes = ref.pack_lowrank_codes(torch.from_numpy(values), layout)
    got = cpu.lowrank_scores(torch.from_numpy(query), torch.from_numpy(qproj), torch.from_numpy(scale), scaling, codes,
                             torch.from_numpy(valid), P, S, layout).numpy()
    expect, w = _numpy_lowrank_scores(query, qproj, scale, scaling, values, valid, S)
    # Each int4/int2 weight moves by at most half its step, so each logit by at most half a step
    # times the codes' largest |value| summed; a page's log mass by twice that. The passes' step
    # (cpu.lowrank_passes._slot_weights) keeps a head's whole sum in int16; VNNI's (lowrank_vnni._quantise)
    # is the largest |weight| of its kind (of the half of its kind it is in, at most that) over 127.
    lv = levels[0, 0, wide:, 0]
    if by_vnni:
        n4 = R - wide - narrow
        top4, top2 = (np.abs(w[..., cut]).max(axis=-1, initial=0) for cut in (slice(wide, wide + n4), slice(wide + n4, R)))
        worst = top4 / 127 / 2 * lv[:n4].sum() + top2 / 127 / 2 * lv[n4:].sum()
    else:
        step = (np.abs(w[..., wide:]) * lv).sum(axis=-1) / (32767 - lv.sum())
        worst = step / 2 * lv.sum()
    bound = 2 * worst.max() + 1e-4
    assert np.array_equal(np.isfinite(got), np.isfinite(expect))
    fin = np.isfinite(expect)
    err = np.abs(got[fin] - expect[fin])
    assert err.max() <= bound
    assert err.mean() <= 2e-3  # rounding errors of many weights mostly cancel: far below the worst case


def test_lowrank_scores_over_tiles_far_below_the_max():
    """The passes sum each tile's pages against the tile's own max and scale the sums to the
    head's max afterwards: a tile 60 nats below the max keeps its pages' scores, one 100 nats
    below (under float32's normal range, 2**-126) scores -inf as a single pass over its tokens
    would, and padding stays -inf."""
    R, G, S = 4, 2, 16
    layout = ref.SketchLayout(R, R, 0)  # int8 channels only: a logit is the weight times the code
    tile = cpu._PASS_TILE
    t = 3 * tile + 5 * S
    rng = np.random.default_rng(7)
    values = np.zeros((1, 1, R, t), np.int8)
    values[0, 0, 0] = rng.integers(0, 11, t)  # logits 0..10
    values[0, 0, 0, :tile] = -60  # tile 0: 60 nats below
    values[0, 0, 0, tile : 2 * tile] = -100  # tile 1: 100 nats below
    query = np.zeros((1, 1, G, R), np.float32)
    query[0, 0, :, 0] = [1.0, 0.9]
    qproj = np.eye(R, dtype=np.float16)[None, None]
    scale = np.ones((1, 1, R), np.float32)
    valid = np.ones((1, t), bool)
    valid[0, -S:] = False  # the last page is padding
    codes = ref.pack_lowrank_codes(torch.from_numpy(values), layout)
    got = cpu.lowrank_scores(torch.from_numpy(query), torch.from_numpy(qproj), torch.from_numpy(scale), 1.0, codes,
                             torch.from_numpy(valid), t // S, S, layout).numpy()[0, 0]
    expect, _ = _numpy_lowrank_scores(query, qproj, scale, 1.0, values, valid, S)
    expect = expect[0, 0]
    per_tile = tile // S
    far = slice(per_tile, 2 * per_tile)
    assert np.all(got[far] == -np.inf)  # 2**-144 of the max: none, as a token's weight under 2**-126 is
    assert np.isneginf(got[-1])
    kept = np.r_[0:per_tile, 2 * per_tile : t // S - 1]
    assert np.all(np.isfinite(got[kept]))
    assert np.abs(got[kept] - expect[kept]).max() < 1e-3
