"""What only the compiled CPU kernels have: calls split across threads, reused scratch,
argument checks, and the torch threading context a decode step runs under."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdrive.kernels import cpu

from kernel_cases import lowrank_case, random_slots


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
    kernel = cpu._sparse_attention
    monkeypatch.setattr(cpu, "_sparse_attention", lambda *a: parts.append(a[0].shape[:2]) or kernel(*a))
    monkeypatch.setattr(cpu, "_ATTENTION_PART_MIN_WORK", 1)
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
    monkeypatch.setattr(cpu, "_PART_MIN_WORK", 1)  # split however small the call
    parts = []
    for name in ("_lowrank_scores", "_lowrank_select"):
        kernel = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, kernel=kernel: parts.append(a[0].shape[:2]) or kernel(*a))
    split = both()
    # Two calls, each in as many parts as threads (at most one per row, or per head of a single row).
    n = min(3, rows if rows > 1 else c.codes.shape[1])
    assert len(parts) == 2 * n and all(p != c.query.shape[:2] for p in parts)
    for a, b in zip(one, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [4, 0])  # the fused logit pass, and the tiled one
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
