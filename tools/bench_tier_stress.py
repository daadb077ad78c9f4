"""``kvdrive-bench tier``'s two stress measurements, through the same adapters and drivers.

- **Loads during stores** (``--modes contention``): the latency of a cache-hit load of
  ``JOB_BLOCKS`` blocks (all in the DRAM tier), alone and while the adapter stores fresh
  blocks without pause, in alternating rounds of one run, so both see the same machine.
  vLLM is driven as its scheduler drives the tier, from one thread: two store jobs are
  kept in flight, a load job is submitted and ``get_finished_jobs`` polled until its
  result comes; SGLang as its cache controller: ``batch_set_v1`` on a backup thread,
  ``batch_get_v1`` on the prefetch thread. One load runs untimed first (the adapter
  connects on first use). The target: a load's p99 during stores at most twice its p99
  alone (with fewer than 100 loads a side, the p99 is the slowest load).
- **Fill** (``--modes fill``): one adapter stores ``JOB_BLOCKS``-block jobs of fresh keys,
  one after another, until it has stored ten times the daemon's DRAM tier (after one
  untimed job: the adapter connects on first use); the store throughput of the first
  tenth of the blocks against the last tenth's. The first timed job's blocks are loaded
  back and checked at the end.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdrive.tools.bench_tier import DRIVERS, JOB_BLOCKS, _note, engine_of

STORE_JOBS_IN_FLIGHT = 2  # vLLM: store jobs kept submitted during the "during stores" loads
FILL_TIMES = 10  # the fill stores this many times the DRAM tier
CONTENTION_DRAM_JOBS = 16  # the contention daemon's DRAM tier, in jobs of blocks


@dataclass
class ContentionRow:
    adapter: str
    loads: int  # per side
    p50_alone_ms: float
    p99_alone_ms: float
    p50_during_ms: float
    p99_during_ms: float
    p99_ratio: float
    store_gbps_during: float  # what the stores moved meanwhile


@dataclass
class FillRow:
    adapter: str
    dram_bytes: int
    stored_bytes: int
    first_tenth_gbps: float
    last_tenth_gbps: float
    ratio: float  # last tenth / first tenth


def nearest_rank_ms(samples: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``samples`` (seconds), in ms."""
    ordered = sorted(samples)
    return 1e3 * ordered[min(len(ordered) - 1, max(0, int(np.ceil(q * len(ordered))) - 1))]


def _daemon(root: Path, dram: int, ssd_max: int):
    from kvdrive_client import StoreClient  # noqa: PLC0415
    from kvdrive_client.embedded import EmbeddedDaemon  # noqa: PLC0415

    daemon = EmbeddedDaemon(dram=str(dram), ssd_max=str(ssd_max), root=root,
                            extra_args=["--io-threads", "8", "--log-level", "WARNING"])
    probe = StoreClient(daemon.address, timeout=60.0)
    try:
        daemon.wait_ready(lambda: probe.ping(timeout=0.5))
    finally:
        probe.close()
    return daemon


class _Fresh:
    """Keys never stored before, in jobs of ``JOB_BLOCKS``, each key's bytes a source row."""

    def __init__(self, adapter: str) -> None:
        self.adapter, self.count = adapter, 0

    def job(self) -> list:
        keys = [self.key(self.count + i) for i in range(JOB_BLOCKS)]
        self.count += JOB_BLOCKS
        return keys

    def key(self, i: int):
        return b"fresh" + i.to_bytes(8, "little") if engine_of(self.adapter) == "vllm" else f"f{i:063x}"


# ---------------------------------------------------------------- loads during stores


def _vllm_rounds(d, rounds: int, loads: int) -> tuple[list[float], list[float], int, float]:
    warm, fresh = d.keys[:JOB_BLOCKS], _Fresh("vllm")
    sources, targets = np.arange(JOB_BLOCKS), d.n + np.arange(JOB_BLOCKS)  # stores read rows, loads land apart
    alone, during, stored, store_s = [], [], 0, 0.0
    stores: set[int] = set()
    for _ in range(rounds):
        for feeding, samples in ((False, alone), (True, during)):
            t_phase = time.perf_counter()
            for _ in range(loads):
                if feeding:
                    while len(stores) < STORE_JOBS_IN_FLIGHT:
                        stores.add(d.submit(fresh.job(), sources, promotion=False))
                job = d.submit(warm, targets, promotion=True)
                t0 = time.perf_counter()
                while True:
                    done = d.finished()
                    stored += JOB_BLOCKS * len(stores.intersection(done))
                    stores.difference_update(done)
                    if feeding:
                        while len(stores) < STORE_JOBS_IN_FLIGHT:
                            stores.add(d.submit(fresh.job(), sources, promotion=False))
                    if job in done:
                        samples.append(time.perf_counter() - t0)
                        break
                    time.sleep(0.0005)
            while stores:  # the alone side starts with no store in flight
                done = d.finished()
                stored += JOB_BLOCKS * len(stores.intersection(done))
                stores.difference_update(done)
                time.sleep(0.0005)
            if feeding:
                store_s += time.perf_counter() - t_phase
    return alone, during, stored, store_s


def _sglang_rounds(d, rounds: int, loads: int) -> tuple[list[float], list[float], int, float]:
    warm, fresh = d.keys[:JOB_BLOCKS], _Fresh("sglang")
    alone, during, stored, store_s = [], [], [0], 0.0

    def backups(stop: threading.Event, started: threading.Event) -> None:
        while not stop.is_set():
            started.set()
            d.put(fresh.job(), 0, JOB_BLOCKS)  # pages 0.. hold the source bytes
            stored[0] += JOB_BLOCKS

    for _ in range(rounds):
        for feeding, samples in ((False, alone), (True, during)):
            stop, started = threading.Event(), threading.Event()
            thread = threading.Thread(target=backups, args=(stop, started), name="backup") if feeding else None
            t_phase = time.perf_counter()
            if thread is not None:
                thread.start()
                started.wait(10)
            for _ in range(loads):
                t0 = time.perf_counter()
                d.get(warm, JOB_BLOCKS, 2 * JOB_BLOCKS)  # into pages apart from the backups' sources
                samples.append(time.perf_counter() - t0)
            if thread is not None:
                stop.set()
                thread.join()
                store_s += time.perf_counter() - t_phase
    return alone, during, stored[0], store_s


def contention(adapter: str, rows: np.ndarray, root: Path, rounds: int, loads: int) -> ContentionRow:
    """Loads alone and during stores, alternating by round (see the module)."""
    rows = rows[: 2 * JOB_BLOCKS]
    if len(rows) < 2 * JOB_BLOCKS:
        raise ValueError(f"loads during stores need {2 * JOB_BLOCKS} blocks, got {len(rows)}")
    # Room for the warm job and what the stores write meanwhile: 1 GiB at 2 MiB blocks, and a
    # DRAM tier to pre-fault no larger than that needs at smaller blocks.
    daemon = _daemon(root, dram=CONTENTION_DRAM_JOBS * JOB_BLOCKS * rows.shape[1], ssd_max=32 << 30)
    out = np.zeros_like(rows)
    try:
        d = DRIVERS[adapter](daemon.address, rows, out)
        try:
            if engine_of(adapter) == "vllm":
                for promotion in (False, True):  # stored, then loaded once untimed: connections up
                    job = d.submit(d.keys[:JOB_BLOCKS], np.arange(JOB_BLOCKS) + d.n * promotion, promotion)
                    while job not in d.finished():
                        time.sleep(0.001)
                alone, during, stored, store_s = _vllm_rounds(d, rounds, loads)
                loaded = d.primary[d.n: d.n + JOB_BLOCKS].copy()  # no view of the region once it closes
            else:
                d.put(d.keys[:JOB_BLOCKS], 0, JOB_BLOCKS)
                d.get(d.keys[:JOB_BLOCKS], JOB_BLOCKS, 2 * JOB_BLOCKS)  # once untimed: connections up
                alone, during, stored, store_s = _sglang_rounds(d, rounds, loads)
                loaded = np.stack([d.pool.page(JOB_BLOCKS + i).contiguous().view(d.torch.uint8).reshape(-1).numpy()
                                   for i in range(JOB_BLOCKS)])
            if (loaded != rows[:JOB_BLOCKS]).any():
                raise RuntimeError(f"{adapter}: loads during stores brought other bytes than were stored")
        finally:
            d.close()
    finally:
        daemon.stop()
    p50_alone, p99_alone = nearest_rank_ms(alone, 0.5), nearest_rank_ms(alone, 0.99)
    p50_during, p99_during = nearest_rank_ms(during, 0.5), nearest_rank_ms(during, 0.99)
    row = ContentionRow(adapter, len(alone), p50_alone, p99_alone, p50_during, p99_during, p99_during / p99_alone,
                        stored * rows.shape[1] / max(store_s, 1e-9) / 1e9)
    _note(f"  {adapter}: load of {JOB_BLOCKS} blocks p99 {row.p99_alone_ms:.1f} ms alone, {row.p99_during_ms:.1f} ms "
          f"during stores ({row.p99_ratio:.2f}x; stores meanwhile {row.store_gbps_during:.2f} GB/s)")
    return row


# ---------------------------------------------------------------- fill


def fill(adapter: str, rows: np.ndarray, root: Path, dram_bytes: int) -> FillRow:
    """Store fresh blocks until ``FILL_TIMES`` x the DRAM tier; first tenth vs last tenth."""
    rows = rows[:JOB_BLOCKS]
    block_bytes = rows.shape[1]
    jobs = -(-FILL_TIMES * dram_bytes // (JOB_BLOCKS * block_bytes))
    jobs = -(-jobs // 10) * 10  # whole tenths
    daemon = _daemon(root, dram=dram_bytes, ssd_max=jobs * JOB_BLOCKS * block_bytes * 2 + (1 << 30))
    out = np.zeros_like(rows)
    fresh, times = _Fresh(adapter), []
    try:
        d = DRIVERS[adapter](daemon.address, rows, out)
        try:
            _store_job(adapter, d, fresh.job())  # untimed: the adapter connects on first use
            first = None
            for _ in range(jobs):
                keys = fresh.job()
                first = first or keys
                t0 = time.perf_counter()
                _store_job(adapter, d, keys)
                times.append(time.perf_counter() - t0)
            _check_first(adapter, d, first, rows)
        finally:
            d.close()
    finally:
        daemon.stop()
    tenth = jobs // 10
    job_bytes = JOB_BLOCKS * block_bytes
    first_gbps = tenth * job_bytes / sum(times[:tenth]) / 1e9
    last_gbps = tenth * job_bytes / sum(times[-tenth:]) / 1e9
    row = FillRow(adapter, dram_bytes, jobs * job_bytes, first_gbps, last_gbps, last_gbps / first_gbps)
    _note(f"  {adapter}: filled {row.stored_bytes / 2**30:.2f} GiB = {row.stored_bytes / dram_bytes:.1f}x the DRAM "
          f"tier; stores {first_gbps:.2f} GB/s in the first tenth, {last_gbps:.2f} GB/s in the last "
          f"({row.ratio:.2f}x); median job {statistics.median(times) * 1e3:.0f} ms")
    return row


def _store_job(adapter: str, d, keys: list) -> None:
    if engine_of(adapter) == "vllm":
        job = d.submit(keys, np.arange(JOB_BLOCKS), promotion=False)
        while job not in d.finished():
            time.sleep(0.0005)
    else:
        d.put(keys, 0, JOB_BLOCKS)


def _check_first(adapter: str, d, keys: list, rows: np.ndarray) -> None:
    """Load the fill's first job back (long out of the DRAM tier) and compare its bytes."""
    if engine_of(adapter) == "vllm":
        job = d.submit(keys, d.n + np.arange(JOB_BLOCKS), promotion=True)
        while job not in d.finished():
            time.sleep(0.001)
        loaded = d.primary[d.n:]
    else:
        d.get(keys, 0, JOB_BLOCKS)
        loaded = np.stack([d.pool.page(i).contiguous().view(d.torch.uint8).reshape(-1).numpy()
                           for i in range(JOB_BLOCKS)])
    if (loaded != rows).any():
        raise RuntimeError(f"{adapter}: the fill's first blocks loaded back with other bytes")
