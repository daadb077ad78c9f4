import numpy as np
import pytest

from kvdrive.layout import ALIGN, plan_reads

BB = 8192  # a float16 block of 16 tokens x 128 dims, K and V


def check_plan(plan, offsets, block_bytes, max_gap, max_io, align=ALIGN):
    """Every block lies whole inside its read; reads are aligned, sorted, disjoint and bounded."""
    offsets = np.asarray(offsets, dtype=np.int64)
    assert len(plan.run_of) == len(plan.offset_in_run) == len(offsets)
    assert (plan.starts % align == 0).all() and (plan.ends % align == 0).all()
    assert (plan.starts < plan.ends).all()
    # Reads come in file order. Blocks smaller than the alignment may put two reads on
    # one 4 KiB page, so only the block spans themselves are required to be disjoint.
    assert (plan.starts[1:] >= plan.starts[:-1]).all() and (plan.ends[1:] >= plan.ends[:-1]).all()
    # Reconstruct each block's file offset from its run and its offset in the run.
    np.testing.assert_array_equal(plan.starts[plan.run_of] + plan.offset_in_run, offsets)
    assert (plan.offset_in_run + block_bytes <= (plan.ends - plan.starts)[plan.run_of]).all()
    # Runs split where a block *starts* past max_io, so the last block of a read may
    # stick out by up to one block (exactly max_io when blocks tile it).
    longest = max(max_io, block_bytes) + (0 if max_io % block_bytes == 0 else block_bytes)
    assert ((plan.ends - plan.starts) <= longest + 2 * align).all()
    # Every read starts at one of its blocks (no read covers only a gap).
    assert set(np.unique(plan.run_of).tolist()) == set(range(plan.num_reads))
    assert plan.bytes_read == int((plan.ends - plan.starts).sum())


def test_no_blocks_means_no_reads():
    plan = plan_reads(np.array([], dtype=np.int64), BB)
    assert plan.num_reads == 0 and plan.bytes_read == 0 and len(plan.run_of) == 0


def test_adjacent_blocks_merge_into_one_read():
    offs = np.arange(8) * BB
    plan = plan_reads(offs, BB, max_gap=0)
    assert plan.num_reads == 1
    assert (plan.starts[0], plan.ends[0]) == (0, 8 * BB)
    check_plan(plan, offs, BB, 0, 4 << 20)


def test_gaps_up_to_max_gap_are_read_through():
    offs = np.array([0, BB + 4096, 2 * BB + 4096 + 8192])  # gaps of 4096 then 8192 bytes
    plan = plan_reads(offs, BB, max_gap=8192)
    assert plan.num_reads == 1 and plan.bytes_read == offs[-1] + BB
    plan = plan_reads(offs, BB, max_gap=4096)
    assert plan.num_reads == 2
    np.testing.assert_array_equal(plan.run_of, [0, 0, 1])
    plan = plan_reads(offs, BB, max_gap=4095)
    assert plan.num_reads == 3
    check_plan(plan, offs, BB, 4095, 4 << 20)


def test_long_runs_split_at_max_io_on_block_boundaries():
    offs = np.arange(100) * BB
    max_io = 10 * BB
    plan = plan_reads(offs, BB, max_gap=0, max_io=max_io)
    assert plan.num_reads == 10
    assert ((plan.ends - plan.starts) == max_io).all()
    np.testing.assert_array_equal(plan.run_of, np.arange(100) // 10)
    check_plan(plan, offs, BB, 0, max_io)


def test_a_block_larger_than_max_io_is_one_read():
    big = 3 * ALIGN * 4
    offs = np.array([0, big, 2 * big])
    plan = plan_reads(offs, big, max_gap=0, max_io=ALIGN)
    assert plan.num_reads == 3 and ((plan.ends - plan.starts) == big).all()


def test_duplicates_share_one_read_and_keep_their_own_slots():
    offs = np.array([2 * BB, 0, 2 * BB, 0, BB])
    plan = plan_reads(offs, BB, max_gap=0)
    assert plan.num_reads == 1 and plan.bytes_read == 3 * BB
    np.testing.assert_array_equal(plan.offset_in_run, offs)
    check_plan(plan, offs, BB, 0, 4 << 20)


def test_unaligned_blocks_are_covered_by_aligned_reads():
    bb = 1000  # not a multiple of the alignment
    offs = np.array([0, 1000, 50_000, 51_000, 200_123])
    plan = plan_reads(offs, bb, max_gap=0)
    assert plan.num_reads == 3
    np.testing.assert_array_equal(plan.starts, [0, 49152, 196608])
    np.testing.assert_array_equal(plan.ends, [4096, 53248, 204800])
    check_plan(plan, offs, bb, 0, 4 << 20)


def test_request_order_is_kept_in_the_mapping():
    offs = np.array([9 * BB, 0, 5 * BB, BB, 100 * BB])
    plan = plan_reads(offs, BB, max_gap=3 * BB, max_io=4 << 20)
    np.testing.assert_array_equal(plan.run_of, [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(plan.offset_in_run, [9 * BB, 0, 5 * BB, BB, 0])
    plan = plan_reads(offs, BB, max_gap=BB, max_io=4 << 20)
    np.testing.assert_array_equal(plan.run_of, [2, 0, 1, 0, 3])
    np.testing.assert_array_equal(plan.offset_in_run, [0, 0, 0, BB, 0])
    check_plan(plan, offs, BB, BB, 4 << 20)


@pytest.mark.parametrize("seed", range(12))
def test_random_sparse_sets_reconstruct_exactly(seed):
    rng = np.random.default_rng(seed)
    bb = int(rng.choice([512, 4096, 8192, 12288, 65536]))
    n = int(rng.integers(1, 300))
    slots = rng.integers(0, 2000, n)  # duplicates on purpose
    offs = slots * bb
    max_gap = int(rng.choice([0, bb, 4 * bb, 64 << 10]))
    max_io = int(rng.choice([4096, 8 * bb, 1 << 20, 1 << 40]))
    plan = plan_reads(offs, bb, max_gap=max_gap, max_io=max_io)
    check_plan(plan, offs, bb, max_gap, max_io)
    # Between consecutive reads the hole between their blocks exceeds max_gap, unless
    # the split came from max_io.
    if max_io >= int(offs.max()) + bb:
        first = np.array([offs[plan.run_of == r].min() for r in range(plan.num_reads)])
        last_end = np.array([offs[plan.run_of == r].max() + bb for r in range(plan.num_reads)])
        assert (first[1:] - last_end[:-1] > max_gap).all()
