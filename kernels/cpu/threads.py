"""How a CPU kernel call shares the host's cores: split into parts of whole rows (or heads)
on a thread pool, and the torch threading a decode step runs its own ops under."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch


# A low-rank call is split across threads only where each part has at least this much
# work: (token, query head) pairs scored, about 0.4 ms of kernel time here. On a host
# whose two CPUs are one core's hyperthreads a split only pays on long calls: SmolLM2
# at 7K tokens and batch 4 (2.6e5 pairs) took 0.45-0.65 ms on one thread and
# 0.75-0.81 ms in two parts; Llama-3-8B's shape at 32K and batch 4 (4.2e6 pairs),
# 5.6-7.0 ms on one and 4.5-4.8 ms in two.
_PART_MIN_WORK = 1 << 18
_pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvdrive-kernel")  # threads start on first use


_lent = threading.local()


def kernel_threads() -> int:
    """Threads a kernel call here may split across: the calling thread's torch intra-op
    threads, or the count it had before :func:`one_torch_thread`."""
    return getattr(_lent, "threads", None) or torch.get_num_threads()


@contextmanager
def one_torch_thread():
    """Run the calling thread's torch ops on one intra-op thread; the kernels here keep its threads.

    A decode step's bookkeeping is many small torch ops. Split across two intra-op
    threads on a 2-core host where the daemon or the pipeline's front thread holds
    the other core, each such op waits for its second thread to be scheduled (single
    ops of 0.2 ms took up to 14 ms). The compiled kernels split their own work
    (:func:`_in_parts`) and are not affected. torch's thread count is per thread.
    """
    threads = torch.get_num_threads()
    if threads == 1 or getattr(_lent, "threads", None):
        yield
        return
    _lent.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _lent.threads = None


def parts_for(b_n: int, h_n: int, work_per_head: int, min_work: int | None = None) -> int:
    """How many parts :func:`_in_parts` cuts a call of ``[b_n, h_n]`` into (1: the whole call
    on the calling thread)."""
    units = b_n if b_n > 1 else h_n
    return max(1, min(kernel_threads(), units, (b_n * h_n * work_per_head) // (min_work or _PART_MIN_WORK)))


def _in_parts(b_n: int, h_n: int, work_per_head: int, fn, min_work: int | None = None) -> None:
    """Run ``fn(rows, heads)`` on slices covering ``[b_n, h_n]``, on up to :func:`kernel_threads` threads.

    The calling thread runs the first part. Slices are whole rows (for a single row,
    whole heads), so every part's arrays stay C-contiguous. A thread held to one
    intra-op thread (the pipeline's front stage) runs the whole call itself. A call
    in one part gets ``fn(None, None)``: the whole arrays, no slices (:func:`_cut`).
    """
    by_rows = b_n > 1
    units = b_n if by_rows else h_n
    n = parts_for(b_n, h_n, work_per_head, min_work)
    if n == 1:
        fn(None, None)
        return
    cuts = [units * i // n for i in range(n + 1)]
    parts = [(slice(cuts[i], cuts[i + 1]), slice(None)) if by_rows else (slice(None), slice(cuts[i], cuts[i + 1]))
             for i in range(n)]
    futures = [_pool.submit(fn, *p) for p in parts[1:]]
    try:
        fn(*parts[0])
    finally:
        for f in futures:
            f.result()


def _cut(arrays: tuple, rows, heads, rows_only: tuple[int, ...] = ()) -> tuple:
    """``arrays`` cut to a part of :func:`_in_parts`: ``[rows, heads]``, or ``[rows]`` for the
    positions in ``rows_only`` (per-row arrays); as they are for the whole call (``rows`` None)."""
    if rows is None:
        return arrays
    return tuple(x[rows] if i in rows_only else x[rows, heads] for i, x in enumerate(arrays))
