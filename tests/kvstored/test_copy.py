"""The daemon's byte mover: serial and parallel kernels against a numpy reference."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kvstored.copy as copy_mod
from kvstored.copy import _gather_scatter, _gather_scatter_parallel, gather_scatter


def reference(src, src_offs, dst, dst_offs, nbytes):
    out = dst.copy()
    for s, d in zip(src_offs, dst_offs):
        out[d : d + nbytes] = src[s : s + nbytes]
    return out


@pytest.mark.parametrize("kernel", [_gather_scatter, _gather_scatter_parallel], ids=["serial", "parallel"])
def test_kernels_match_the_reference_at_unaligned_offsets(kernel):
    rng = np.random.default_rng(0)
    src = np.frombuffer(rng.bytes(1 << 20), dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    nbytes = 8192
    src_offs = rng.integers(0, len(src) - nbytes, 64).astype(np.int64)
    dst_offs = (np.arange(64) * (nbytes + 3) + 5).astype(np.int64)
    expect = reference(src, src_offs, dst, dst_offs, nbytes)
    assert kernel(src, src_offs, dst, dst_offs, nbytes)
    np.testing.assert_array_equal(dst, expect)


def test_wrapper_accepts_any_int_offsets_and_empty_lists():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    gather_scatter(src, np.array([], dtype=np.int64), dst, np.array([], dtype=np.int64), 8)
    assert not dst.any()
    gather_scatter(src, np.array([8, 0], dtype=np.int32), dst, np.array([0, 56], dtype=np.int32), 8)
    np.testing.assert_array_equal(dst[:8], src[8:16])
    np.testing.assert_array_equal(dst[56:], src[:8])


@pytest.mark.parametrize(
    "src_offs, dst_offs",
    [([-1], [0]), ([0], [-8]), ([57], [0]), ([0], [60]), ([0, 8], [0])],
    ids=["negative-src", "negative-dst", "past-src", "past-dst", "length-mismatch"],
)
def test_out_of_bounds_blocks_are_refused_and_nothing_is_copied(src_offs, dst_offs):
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        gather_scatter(src, np.array(src_offs), dst, np.array(dst_offs), 8)
    assert not dst.any()


def test_read_only_or_wrongly_typed_destinations_are_refused():
    src = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="writable"):
        gather_scatter(src, np.array([0]), src.copy().view(np.uint16), np.array([0]), 8)
    frozen = np.zeros(64, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        gather_scatter(src, np.array([0]), frozen, np.array([0]), 8)


def test_streaming_stores_match_the_reference_aligned_or_not():
    rng = np.random.default_rng(1)
    src = np.frombuffer(rng.bytes(1 << 20), dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    nbytes = 4096
    # Aligned destinations stream, the odd ones fall back to memcpy, in one call.
    dst_offs = np.array([0, 4096 + 7, 3 * 4096, 5 * 4096 + 32, 7 * 4096 + 16], dtype=np.int64)
    src_offs = rng.integers(0, len(src) - nbytes, len(dst_offs)).astype(np.int64)
    expect = reference(src, src_offs, dst, dst_offs, nbytes)
    assert _gather_scatter(src, src_offs, dst, dst_offs, nbytes, True)
    np.testing.assert_array_equal(dst, expect)
    # A block size that is no multiple of the vector width never streams.
    dst[:] = 0
    expect = reference(src, src_offs, dst, dst_offs, 4000)
    assert _gather_scatter(src, src_offs, dst, dst_offs, 4000, True)
    np.testing.assert_array_equal(dst, expect)


def test_large_copies_through_the_wrapper_are_exact():
    rng = np.random.default_rng(2)
    nbytes, count = 8192, 4096  # 32 MiB: the streaming path
    src = np.frombuffer(rng.bytes(count * nbytes * 2), dtype=np.uint8)
    dst = np.zeros(count * nbytes, dtype=np.uint8)
    src_offs = rng.permutation(2 * count)[:count].astype(np.int64) * nbytes
    dst_offs = np.arange(count, dtype=np.int64) * nbytes
    gather_scatter(src, src_offs, dst, dst_offs, nbytes)
    np.testing.assert_array_equal(dst.reshape(count, nbytes), src.reshape(-1, nbytes)[src_offs // nbytes])


def test_copies_split_with_the_helper_are_exact_beside_copies_on_other_threads():
    """A copy of SPLIT_MIN_BYTES or more on the main thread shares its chunks with the
    helper thread where it is idle; copies on three other threads at once run alone. Every
    byte of every copy is right."""
    rng = np.random.default_rng(3)
    nbytes, count = 64 << 10, copy_mod.SPLIT_MIN_BYTES // (64 << 10) + 3  # past the size, chunks not whole
    src = np.frombuffer(rng.bytes(4 * count * nbytes), dtype=np.uint8)
    barrier, errors = threading.Barrier(4), []

    def run(seed: int) -> None:
        r = np.random.default_rng(seed)
        dst = np.zeros(count * nbytes + 7, dtype=np.uint8)
        barrier.wait()
        for _ in range(8):
            src_offs = r.permutation(4 * count)[:count].astype(np.int64) * nbytes
            dst_offs = r.permutation(count).astype(np.int64) * nbytes + 7
            gather_scatter(src, src_offs, dst, dst_offs, nbytes)
            placed = src_offs[np.argsort(dst_offs)] // nbytes  # the source block of each destination row
            if not np.array_equal(dst[7:].reshape(count, nbytes), src.reshape(-1, nbytes)[placed]):
                errors.append(seed)

    with ThreadPoolExecutor(3) as pool:
        others = pool.map(run, range(1, 4))
        run(0)  # this (the main) thread's copies are the ones split
        list(others)
    assert errors == []
    assert copy_mod._HELPER._thread is not None and copy_mod._HELPER._thread.is_alive()


def test_a_split_copy_refuses_a_block_outside_before_copying_any():
    nbytes, count = 64 << 10, copy_mod.SPLIT_MIN_BYTES // (64 << 10) * 2
    src = np.ones(count * nbytes, dtype=np.uint8)
    dst = np.zeros(count * nbytes, dtype=np.uint8)
    offs = np.arange(count, dtype=np.int64) * nbytes
    bad = offs.copy()
    bad[-1] += 1  # the last block runs one byte past the end
    with pytest.raises(ValueError, match="outside"):
        gather_scatter(src, offs, dst, bad, nbytes)
    assert not dst.any()


def test_an_error_in_a_chunk_the_helper_copies_reaches_the_caller(monkeypatch):
    nbytes, count = 64 << 10, copy_mod.SPLIT_MIN_BYTES // (64 << 10) * 4
    src = np.ones(count * nbytes, dtype=np.uint8)
    dst = np.zeros(count * nbytes, dtype=np.uint8)
    offs = np.arange(count, dtype=np.int64) * nbytes
    kernel, threads, helper_took = copy_mod._gather_scatter, set(), threading.Event()

    def failing(s, s_offs, d, d_offs, n, stream):
        threads.add(threading.current_thread().name)
        if threading.current_thread().name == "kvstored-copy":
            helper_took.set()
            raise RuntimeError("chunk failed")
        helper_took.wait(10)  # the caller's first chunk waits until the helper has taken one
        return kernel(s, s_offs, d, d_offs, n, stream)

    deadline = time.monotonic() + 10
    while copy_mod._HELPER._busy:  # the helper may still be winding down an earlier copy
        assert time.monotonic() < deadline, "the copy helper stayed busy"
        time.sleep(0.001)
    monkeypatch.setattr(copy_mod, "_gather_scatter", failing)
    with pytest.raises(RuntimeError, match="chunk failed"):
        gather_scatter(src, offs, dst, offs, nbytes)
    assert "kvstored-copy" in threads
