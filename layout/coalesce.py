"""Block-level sparse reads: turn a scattered set of blocks into few large I/Os."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvdrive.layout.format import ALIGN


@dataclass(frozen=True)
class ReadPlan:
    """Reads covering a set of blocks.

    ``starts``/``ends`` are the aligned byte ranges of the reads. Block ``i`` of the
    request (in request order) lies at ``run_of[i]``, ``offset_in_run[i]`` bytes into
    that read.
    """

    starts: np.ndarray
    ends: np.ndarray
    run_of: np.ndarray
    offset_in_run: np.ndarray

    @property
    def num_reads(self) -> int:
        return len(self.starts)

    @property
    def bytes_read(self) -> int:
        return int((self.ends - self.starts).sum())


def plan_reads(
    offsets: np.ndarray,
    block_bytes: int,
    max_gap: int = 64 * 1024,
    max_io: int = 4 << 20,
    align: int = ALIGN,
) -> ReadPlan:
    """Plan reads for blocks at file ``offsets``, each ``block_bytes`` long.

    Neighbouring blocks merge into one read when the hole between them is at most
    ``max_gap`` bytes (reading a small hole is cheaper than another I/O); a read
    never grows past ``max_io`` bytes unless a single block is larger.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ReadPlan(empty, empty, empty, empty)
    order = np.argsort(offsets, kind="stable")
    sorted_offs = offsets[order]
    sorted_ends = sorted_offs + block_bytes
    # Running maximum of block ends: duplicates and overlaps never open a new read.
    reach = np.maximum.accumulate(sorted_ends)
    gap = np.empty(n, dtype=np.int64)
    gap[0] = 0
    gap[1:] = sorted_offs[1:] - reach[:-1]
    new_run = gap > max_gap
    new_run[0] = True
    run_id = np.cumsum(new_run) - 1
    run_first = sorted_offs[new_run]
    # Split runs longer than max_io into max_io-sized pieces at block boundaries.
    piece = (sorted_offs - run_first[run_id]) // max(max_io, block_bytes)
    split = np.empty(n, dtype=bool)
    split[0] = True
    split[1:] = (run_id[1:] != run_id[:-1]) | (piece[1:] != piece[:-1])
    run_id = np.cumsum(split) - 1
    first_idx = np.flatnonzero(split)
    starts = sorted_offs[first_idx] // align * align
    run_reach = np.maximum.reduceat(sorted_ends, first_idx)
    ends = (run_reach + align - 1) // align * align
    run_of = np.empty(n, dtype=np.int64)
    offset_in_run = np.empty(n, dtype=np.int64)
    run_of[order] = run_id
    offset_in_run[order] = sorted_offs - starts[run_id]
    return ReadPlan(starts, ends, run_of, offset_in_run)
