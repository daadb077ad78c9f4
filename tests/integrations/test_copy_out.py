"""Loads copy large blocks out of staging with streaming stores (kvdrive.protocol.copy):
exact at every alignment of the destination, refused outside the source."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvdrive.protocol.copy import STREAM_VEC, copy_out, scatter_out
from kvdrive_client.integrations import blocks as blocks_mod
from kvdrive_client.integrations.blocks import STREAM_OUT_BYTES, BlockStore


def test_every_head_and_tail_alignment_is_exact_and_nothing_around_it_is_touched():
    rng = np.random.default_rng(1)
    src = np.frombuffer(rng.bytes(1 << 16), np.uint8)
    page = np.frombuffer(mmap.mmap(-1, 1 << 16), np.uint8)  # page-aligned: offsets set the alignment
    for off in range(STREAM_VEC + 1):
        for n in (0, 1, STREAM_VEC - 1, STREAM_VEC, 3 * STREAM_VEC + 5, 4096, 4096 + 17):
            page[:] = 0
            at = int(rng.integers(0, len(src) - n + 1))
            copy_out(page[off: off + n], src, at)
            np.testing.assert_array_equal(page[off: off + n], src[at: at + n])
            assert not page[:off].any() and not page[off + n:].any(), (off, n)


def test_a_range_outside_the_source_or_a_bad_array_is_refused_and_nothing_is_copied():
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    for at in (-1, 193, 1 << 40):
        with pytest.raises(ValueError):
            copy_out(dst, src, at)
    assert not dst.any()
    read_only = np.zeros(64, np.uint8)
    read_only.flags.writeable = False
    for bad in (read_only, np.zeros(16, np.uint32), np.zeros((8, 8), np.uint8), np.zeros(128, np.uint8)[::2]):
        with pytest.raises(ValueError):
            copy_out(bad, src, 0)


def test_a_load_of_large_blocks_lands_exact_through_the_streaming_copy(daemon, monkeypatch):
    """Blocks of STREAM_OUT_BYTES, into targets at every few offsets off alignment, one of
    them in two parts (as SGLang's K and V regions): each target holds its own block."""
    bb = STREAM_OUT_BYTES
    calls = []
    real = blocks_mod._copy_out()
    monkeypatch.setattr(blocks_mod, "_copy_out", lambda: lambda d, s, at: calls.append(d.nbytes) or real(d, s, at))
    rng = np.random.default_rng(2)
    blocks = [np.frombuffer(rng.bytes(bb), np.uint8) for _ in range(5)]
    store = BlockStore(bb, engine="test", model="m", address=daemon.address)
    keys = [f"big{i}" for i in range(5)]
    assert store.store(keys, blocks) == [True] * 5
    arena = np.frombuffer(mmap.mmap(-1, 6 * bb), np.uint8)
    targets = [arena[i * bb + 7 * i: (i + 1) * bb + 7 * i] for i in range(4)]
    split = np.zeros(bb, np.uint8)
    targets.append([split[: bb // 2], split[bb // 2:]])  # below STREAM_OUT_BYTES each: copied by numpy
    assert store.load(keys, targets) == [True] * 5
    for block, target in zip(blocks[:4], targets):
        np.testing.assert_array_equal(target, block)
    np.testing.assert_array_equal(split, blocks[4])
    assert calls == [bb] * 4
    store.close()


def test_scatter_out_lands_each_block_at_its_offset_or_refuses_and_copies_nothing():
    rng = np.random.default_rng(3)
    src = np.frombuffer(rng.bytes(1 << 16), np.uint8)
    dst = np.frombuffer(mmap.mmap(-1, 1 << 16), np.uint8)
    scatter_out(dst, [8192, 3, 40000], src, [0, 9000, 100], 5000)
    for d, s in ((8192, 0), (3, 9000), (40000, 100)):
        np.testing.assert_array_equal(dst[d: d + 5000], src[s: s + 5000])
    dst[:] = 0
    for dst_offs, src_offs in (([0, 61000], [0, 0]), ([0, 0], [0, 61000]), ([-1], [0]), ([0], [0, 1])):
        with pytest.raises(ValueError):
            scatter_out(dst, dst_offs, src, src_offs, 5000)
    assert not dst.any()


def test_load_rows_lands_each_block_in_its_row_and_leaves_a_missing_ones_row_alone(daemon):
    """As the vLLM tier loads into its CPU tier: rows in any order, one key not stored."""
    bb = 64 << 10
    rng = np.random.default_rng(4)
    blocks = [np.frombuffer(rng.bytes(bb), np.uint8) for _ in range(6)]
    store = BlockStore(bb, engine="test", model="m", address=daemon.address)
    keys = [f"row{i}" for i in range(6)]
    assert store.store(keys, blocks) == [True] * 6
    tier = np.frombuffer(mmap.mmap(-1, 10 * bb), np.uint8).reshape(10, bb)
    tier[:] = 7
    rows = [9, 0, 4, 5, 2, 1, 3]
    assert store.load_rows([*keys, "never stored"], tier, rows) == [True] * 6 + [False]
    for block, row in zip(blocks, rows):
        np.testing.assert_array_equal(tier[row], block)
    assert (tier[[3, 6, 7, 8]] == 7).all()
    for bad_rows in ([10], [-1]):
        with pytest.raises(ValueError):
            store.load_rows(keys[:1], tier, bad_rows)
    for bad in (tier[:, : bb // 2], tier.view(np.uint16), np.zeros((4, bb), np.uint8)[::2]):
        with pytest.raises(ValueError):
            store.load_rows(keys[:1], bad, [0])
    store.close()
