"""``kvdrive-bench tier``: the serving engines' adapters moving KV blocks through kvstored.

Blocks have Llama-3-8B's shape: 16 tokens x 32 layers x 8 KV heads x head dim 128, K and
V, 16-bit: 2 MiB each. Through each adapter (vLLM's ``KVDriveTier``, SGLang's
``KVDriveHiCacheStorage``, driven as their engines drive them: vLLM's store and load jobs
of 32 blocks polled through ``get_finished_jobs``, SGLang's ``batch_set_v1`` /
``batch_get_v1`` of its ``STORAGE_BATCH_SIZE`` (128) pages, as its cache controller
calls them; SGLang's host pool in shared memory, as its ``shm`` allocator keeps it, so
that kvstored moves its pages in place; ``vllm-staging`` and ``sglang-staging`` are the
same with blocks copied through staging: vLLM's tier with ``zero_copy`` off, SGLang's
host pool in its default private memory), ``--blocks`` blocks are stored and loaded back against a
real kvstored in two set-ups: the DRAM tier holding every block, and the DRAM tier off
(every load reads the SSD, O_DIRECT); and with the daemon's two ``--sync`` policies:
durable (a store is acknowledged once on the SSD) and write-behind (acknowledged before
the fsync, flushed within a second). Each adapter, tier and policy gets a daemon of its
own.

Beside them, the engine's own backend for the same blocks, driven the same way, its files
under ``--dir`` too: vLLM's filesystem tier (``FileSystemTierManager``, built as vLLM's
tiering spec builds it: 16 read and 16 write threads, a file per block, O_DIRECT where the
directory takes it, no fsync) in jobs of 32 blocks polled through ``get_finished_jobs``,
and SGLang's file backend (``HiCacheFile``, buffered writes, no fsync) through
``batch_set`` / ``batch_get`` of 128 pages, as SGLang's cache controller drives a
backend that is not zero-copy.

Each adapter is built as its engine builds it at start-up, and the timing starts once it
has opened its connections and registered the engine's memory with kvstored (as an
engine's start-up gives it time to): the figures are steady-state throughput, and the
time the opening took is printed beside them.

Every figure is GB/s of block bytes, beside baselines measured in the same run: a plain
memcpy of as many bytes here, sequential O_DIRECT reads of each daemon's own data file
(the disk's sequential read) and, for stores, as many bytes written sequentially with
O_DIRECT and one fdatasync beside it (the disk's sequential durable write). That write
is noisy on a virtual disk, so it is measured three times per daemon (before the
stores, after them, after the loads): the ratios take the median, the table shows the
range. Loads are timed :data:`LOAD_PASSES` times each (the engine's memory zeroed before
each pass), ours and the engines' own alike: the median too, and the range, set against
a memcpy timed after each pass rather than the one before the run. Each disk
measurement and each of the engines' own stores and loads starts after an untimed
``sync``, so that it does not pay for dirty pages that an earlier step left. Loaded bytes
are checked against the stored bytes after every pass, the engines' own backends' too; a
mismatch fails the run. The targets printed under the table: KVDrive's write-behind
store at least the engine's own backend's store (neither fsyncs), and KVDrive's durable
store at least 0.8x the disk's durable sequential write.

That is ``--modes rate``; ``contention`` (on by default) and ``fill`` are in
:mod:`kvdrive.tools.bench_tier_stress`: a cache-hit load's latency alone and during
stores, and the store throughput of the first and the last tenth of ten times the
daemon's DRAM tier.

The engines are not installed with KVDrive: their pinned packages are installed once per
machine without dependencies (:mod:`kvdrive.tools.engines`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvdrive.tools.cli_paths import output_file, work_dir
from kvdrive.tools.text_table import text_table

BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, ITEM = 16, 32, 8, 128, 2
LAYER_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2 * ITEM  # one layer's K and V of a block: 64 KiB
BLOCK_BYTES = LAYER_BYTES * LAYERS  # the default block: 2 MiB
DEFAULT_BLOCKS, QUICK_BLOCKS = 1000, 64
JOB_BLOCKS = 32
MODES = ("rate", "contention", "fill")
# Loads per side per round: 500 a side at the default, so that the p99 is the fifth slowest (at
# 100 a side it was the slowest: one run's p99 ratio moved by more than 2x from run to run).
DEFAULT_ROUNDS, QUICK_ROUNDS, LOADS_PER_ROUND = 10, 4, 50
DEFAULT_FILL_DRAM, QUICK_FILL_DRAM = 256 << 20, 64 << 20
ADAPTERS = ("vllm", "sglang", "vllm-staging", "sglang-staging")
DEFAULT_ADAPTERS = ("vllm", "sglang")
TIERS = ("dram", "ssd")
SYNCS = ("durable", "write-behind")  # kvstored's --sync policies
ENGINE_OWN = {"vllm": "vllm fs tier", "sglang": "sglang file"}  # each engine's own backend, as rows name it
DISK_WRITES = 3  # the disk's durable sequential write, per daemon: before the stores, after them, after the loads
# Timed loads of every block, per adapter and daemon: one pass of 4,000 64 KiB blocks is 32
# SGLang calls of about 2 ms, whose total moved by a fifth between runs of the same code.
LOAD_PASSES = 3
WRITE_BEHIND_TARGET, DURABLE_TARGET = 1.0, 0.8  # vs the engine's own store; vs the disk's durable write
LOAD_TARGET = 0.5  # a load from the DRAM tier vs a memcpy


@dataclass
class Row:
    adapter: str
    tier: str  # dram, ssd; fs for the engines' own backends
    op: str
    blocks: int
    seconds: float
    gbps: float
    vs_memcpy: float
    vs_disk_seq: float | None  # None for the engines' own backends (no one data file to read back)
    vs_disk_write: float | None = None  # KVDrive's stores: against the disk's sequential durable write (median)
    backend: str = "kvdrive"  # or the engine's own (ENGINE_OWN)
    sync: str = "durable"  # KVDrive: the daemon's --sync; the engines' own: none (they never fsync)
    vs_engine: float | None = None  # KVDrive's stores and loads: against the engine's own backend's
    gbps_min: float | None = None  # disk seq write, loads: the lowest and highest of its measurements
    gbps_max: float | None = None
    memcpy_gbps: float | None = None  # loads: the memcpy timed beside their passes, which vs_memcpy is against


def _disk_seq_write(directory: Path, nbytes: int, io_bytes: int = BLOCK_BYTES) -> float:
    """GB/s of writing ``nbytes`` sequentially to a new file in ``directory``, O_DIRECT in
    ``io_bytes`` writes, then fdatasync (what a durable store must at least wait for).
    An untimed sync first, so that earlier writes' dirty pages are not flushed in its time."""
    os.sync()
    io_bytes = min(io_bytes, nbytes)  # small blocks: whole multiples of 64 KiB, still O_DIRECT-aligned
    path = directory / "bench-seq-write"
    buf = mmap.mmap(-1, io_bytes)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).bytes(io_bytes))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes - nbytes % io_bytes, io_bytes):
            if os.pwritev(fd, [buf], off) != io_bytes:
                raise OSError(f"short write at {off} of {path}")
        os.fdatasync(fd)
        return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        path.unlink()
        buf.close()


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _memcpy_gbps(src: np.ndarray, dst: np.ndarray, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def _timed(step) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = step()
    return time.perf_counter() - t0, out


def _timed_loads(driver, what: str, rows: np.ndarray, scratch: np.ndarray) -> tuple[list[float], float]:
    """The seconds of :data:`LOAD_PASSES` loads of every block through ``driver``, its
    memory zeroed before each (untimed) and its bytes checked after each; and the GB/s of
    a memcpy of ``rows`` into ``scratch`` (the run's one, faulted in) timed after each pass
    (the median). The host's memory bandwidth moved by a third between runs here (a memcpy
    at 8.8 to 12.9 GB/s), so a load is set against the copies made beside it, not one made
    before the run."""
    secs, copies = [], []
    for _ in range(LOAD_PASSES):
        driver.prepare_load()
        secs.append(_timed(driver.load)[0])
        _check_loaded(what, driver.loaded(), rows)
        copies.append(_memcpy_gbps(rows, scratch, repeats=1))
    return secs, statistics.median(copies)


def _load_row(row: Row, loads: list[float], nbytes: int, memcpy: float) -> Row:
    """``row`` (a load's, at the median of ``loads``) with the range of its passes, set
    against ``memcpy``, the copies timed beside them."""
    return replace(row, gbps_min=nbytes / max(loads) / 1e9, gbps_max=nbytes / min(loads) / 1e9,
                   vs_memcpy=row.gbps / memcpy, memcpy_gbps=memcpy)


def _check_loaded(what: str, loaded: np.ndarray, rows: np.ndarray) -> None:
    bad = int((loaded != rows).any(axis=1).sum())
    if bad:
        raise RuntimeError(f"{what} loaded {bad} of {len(rows)} blocks with other bytes")


# ---------------------------------------------------------------- the two adapters, as their engines drive them


def engine_of(adapter: str) -> str:
    """The engine an adapter name stands for (``vllm-staging`` is vLLM's tier too, ``sglang-staging`` SGLang's)."""
    return adapter.split("-")[0]


def _wait_open(store) -> float | None:
    """Seconds until ``store`` (a :class:`~kvdrive_client.integrations.blocks.BlockStore`, or
    None for an engine's own backend) has opened its channels and registered the engine's
    memory with kvstored, which the adapters start when the engine builds them, at its
    start-up, long before its first store. The stores are timed after it: steady-state
    throughput, not start-up (the first registration of a shared pool compiles kvstored's
    SIGBUS guard, 0.15-0.3 s on a 2-core host)."""
    if store is None:
        return None
    t0 = time.perf_counter()
    store.wait_open()
    return time.perf_counter() - t0


def _vllm_region(rows: int, width: int):
    """vLLM's own CPU tier of ``rows`` chunks of ``width`` bytes, as its tiering spec makes it
    in the scheduler (``SharedOffloadRegion``, rank None: a file in /dev/shm, mapped and
    pre-faulted); the region and its rows as an array."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: PLC0415

    region = SharedOffloadRegion(engine_id=f"kvdrive-bench-{os.getpid()}-{time.monotonic_ns()}", num_chunks=rows,
                                 rank=None, kv_bytes_per_chunk=width, cpu_page_size=width)
    return region, np.frombuffer(region.create_kv_memoryview().cast("B"), dtype=np.uint8).reshape(rows, width)


class VllmDriver:
    """vLLM's tiering manager's side: jobs of ``JOB_BLOCKS`` chunks, results polled, its CPU
    tier vLLM's own shared region."""

    zero_copy = True

    def __init__(self, address: str, rows: np.ndarray, out: np.ndarray) -> None:
        from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415 - needs vLLM on the path
        from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: PLC0415

        self.n = len(rows)
        self._job, self._ctx = TransferJob, ReqContext(req_id="bench")
        # Stores read the source rows; loads land in the second half of one CPU tier.
        self.region, self.primary = _vllm_region(2 * self.n, rows.shape[1])
        self.primary[: self.n] = rows
        self.tier = self._make_tier(address, memoryview(self.primary))
        self.open_s = _wait_open(getattr(self.tier, "store", None))  # vLLM builds its tiers at start-up
        self.keys = [b"bench" + i.to_bytes(8, "little") for i in range(self.n)]
        self._next_job = 0

    def _make_tier(self, address: str, view: memoryview):
        from kvdrive_client.integrations.vllm import KVDriveTier  # noqa: PLC0415

        return KVDriveTier(SimpleNamespace(config=None), view, "KVDriveTier", address=address, model="llama-3-8b",
                           timeout=600.0, zero_copy=self.zero_copy)

    def submit(self, keys: list, chunk_ids: np.ndarray, promotion: bool) -> int:
        """Submit a load (``promotion``) or store job of ``keys`` to or from those CPU-tier
        chunks, as vLLM's tiering manager does; its job id."""
        self._next_job += 1
        submit = self.tier.submit_load if promotion else self.tier.submit_store
        submit(self._job(job_id=self._next_job, keys=keys, chunk_ids=chunk_ids, is_promotion=promotion,
                         req_context=self._ctx))
        return self._next_job

    def finished(self) -> list[int]:
        """The ids of the jobs finished since the last call (RuntimeError for a failed one)."""
        out = []
        for r in self.tier.get_finished_jobs():
            if not r.success:
                detail = self.tier.stats() if hasattr(self.tier, "stats") else "see vLLM's log"
                raise RuntimeError(f"vLLM job {r.job_id} failed: {detail}")
            out.append(r.job_id)
        return out

    def _run(self, promotion: bool) -> None:
        pending = set()
        for start in range(0, self.n, JOB_BLOCKS):
            ids = np.arange(start, min(start + JOB_BLOCKS, self.n)) + (self.n if promotion else 0)
            pending.add(self.submit(self.keys[start: start + JOB_BLOCKS], ids, promotion))
        while pending:
            pending.difference_update(self.finished())
            time.sleep(0.001)

    def store(self) -> None:
        self._run(promotion=False)

    def prepare_load(self) -> None:
        """Before a timed load: the chunks it lands in (no store used them) zeroed, so that
        only this load can put the bytes back."""
        self.primary[self.n:] = 0

    def load(self) -> None:
        self._run(promotion=True)

    def loaded(self) -> np.ndarray:
        """After the load, untimed: the loaded blocks, a row each."""
        return self.primary[self.n:]

    def close(self) -> None:
        self.tier.shutdown()
        self.tier = self.primary = None
        gc.collect()  # the tier's views of the region, held in reference cycles, go before it is unmapped
        self.region.cleanup()  # its file in /dev/shm goes


class VllmStagingDriver(VllmDriver):
    """The same, with the tier's ``zero_copy`` off: blocks copied through staging regions."""

    zero_copy = False


class VllmFsDriver(VllmDriver):
    """The same jobs through vLLM's own filesystem tier, its files under the directory
    given in place of an address."""

    def _make_tier(self, address: str, view: memoryview):
        _import_vllm_fs_tier()
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: PLC0415

        return SecondaryTierFactory.create_secondary_tier({"type": "fs", "root_dir": address}, view,
                                                          _vllm_spec(view.strides[0]))


def _import_vllm_fs_tier() -> None:
    """Import vLLM's fs tier. Its file mapper imports vLLM's canonical-layout module for
    ``canonical_format_id`` alone, which it calls only where the canonical layout is on
    (here it is off), and that module's packages import vLLM's whole config: a dozen
    packages that the engine's install without dependencies leaves out. So the mapper is
    imported with that one module stood in for by one whose function refuses to run."""
    name = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping"
    if "vllm.v1.kv_offload.file_mapper" in sys.modules or name in sys.modules:
        return
    stand_in = types.ModuleType(name)

    def canonical_format_id(layout):
        raise NotImplementedError("the bench's vLLM fs tier runs without the canonical layout")

    stand_in.canonical_format_id = canonical_format_id
    sys.modules[name] = stand_in
    try:
        import vllm.v1.kv_offload.file_mapper  # noqa: F401, PLC0415
    finally:
        del sys.modules[name]


def _vllm_spec(block_bytes: int):
    """vLLM's offloading spec for a Llama-3-8B on one GPU (its layers, 16-token blocks, one
    block per chunk), as the connector builds it; the fs tier names its directory from it."""
    from vllm.v1.kv_offload.base import OffloadingSpec  # noqa: PLC0415
    from vllm.v1.kv_offload.config import (  # noqa: PLC0415
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    class Spec(OffloadingSpec):  # the fs tier reads only its config; the connector's parts are never asked for
        def get_manager(self):
            raise NotImplementedError

        def get_worker(self, kv_caches):
            raise NotImplementedError

    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(block_bytes // LAYER_BYTES))
    return Spec(OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=layers, group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False, extra_config={}, engine_id="bench",
        model=OffloadingModelConfig(name="meta-llama/Meta-Llama-3-8B", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True)))


class FlatPages:
    """For a host pool with SGLang's page_first layout (``PageFirstHostPool``): the three
    methods SGLang's cache controller calls for a backend that is not zero-copy (its file
    backend), as SGLang's MHA host pool has them for that layout: a page's K and V as one
    flat copy, an empty flat page, and a flat page put back."""

    def get_data_page(self, index, flat: bool = True):
        page = self.kv_buffer[:, index: index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        import torch  # noqa: PLC0415

        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page) -> None:
        self.kv_buffer[:, index: index + self.page_size] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)


class SglangDriver:
    """SGLang's cache controller's side: ``batch_set_v1`` / ``batch_get_v1`` of ``STORAGE_BATCH_SIZE``
    pages, host indices into a host pool with SGLang's page_first layout, in shared memory
    as SGLang's ``shm`` allocator makes it (``"allocator": "shm"``): moved in place."""

    shm = True

    def __init__(self, address: str, rows: np.ndarray, out: np.ndarray) -> None:
        import torch  # noqa: PLC0415
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE  # noqa: PLC0415 - needs SGLang

        from kvdrive.tools.engines import PageFirstHostPool, ShmHostAllocator  # noqa: PLC0415

        self.n, self.torch, self.out = len(rows), torch, out
        self.batch = STORAGE_BATCH_SIZE  # the pages of one call, as SGLang's cache controller makes them
        pool_class = type("HostPool", (FlatPages, PageFirstHostPool), {})
        self.pool = pool_class(self.n, BLOCK_TOKENS, rows.shape[1] // LAYER_BYTES, KV_HEADS, HEAD_DIM, torch.bfloat16,
                               ShmHostAllocator() if self.shm else None)
        half = rows.shape[1] // 2
        for i, row in enumerate(rows):  # page i holds block i's bytes: its K region, then its V region
            page = self.pool.page(i)
            for kv in (0, 1):
                page[kv].view(torch.uint8).view(-1)[:] = torch.from_numpy(row[kv * half: (kv + 1) * half])
        self.backend = self._make_backend(address)
        self.backend.register_mem_pool_host(self.pool)
        self.open_s = _wait_open(getattr(self.backend, "store", None))  # SGLang registers its pool at start-up
        self.keys = [f"{i:064x}" for i in range(self.n)]

    @staticmethod
    def _config(extra: dict):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: PLC0415 - needs SGLang

        return HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="llama-3-8b", extra_config=extra)

    def _make_backend(self, address: str):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: PLC0415

        return StorageBackendFactory.create_backend("dynamic", self._config(
            {"backend_name": "kvdrive", "module_path": "kvdrive_client.integrations.sglang",
             "class_name": "KVDriveHiCacheStorage", "interface_v1": 1, "address": address, "timeout": 600.0,
             **({"allocator": "shm"} if self.shm else {})}),
            self.pool)

    def _indices(self, start: int, end: int):
        return self.torch.arange(start * BLOCK_TOKENS, end * BLOCK_TOKENS, dtype=self.torch.int64)

    def _detail(self) -> str:
        return str(self.backend.stats()) if hasattr(self.backend, "stats") else "see SGLang's log"

    def put(self, keys: list, start: int, end: int) -> None:
        """``batch_set_v1`` of ``keys`` from host pages ``start`` to ``end``."""
        if not all(self.backend.batch_set_v1(keys, self._indices(start, end))):
            raise RuntimeError(f"SGLang batch_set_v1 failed: {self._detail()}")

    def get(self, keys: list, start: int, end: int) -> None:
        """``batch_get_v1`` of ``keys`` into host pages ``start`` to ``end``."""
        if not all(self.backend.batch_get_v1(keys, self._indices(start, end))):
            raise RuntimeError(f"SGLang batch_get_v1 failed: {self._detail()}")

    def store(self) -> None:
        for start in range(0, self.n, self.batch):
            end = min(start + self.batch, self.n)
            self.put(self.keys[start:end], start, end)

    def prepare_load(self) -> None:
        """Before a timed load: the host pool zeroed, so only the load can put the bytes back.
        Zeroed on this thread: torch's ``zero_`` runs on its OpenMP threads, which held the
        other core for milliseconds after it, into the timed load (64 KiB pages: the load's
        first 128-page call took 4-9 ms after it, 2-3 ms after a zero on one thread)."""
        self.pool.kv_buffer.view(-1).view(self.torch.uint8).numpy().fill(0)

    def load(self) -> None:
        for start in range(0, self.n, self.batch):
            end = min(start + self.batch, self.n)
            self.get(self.keys[start:end], start, end)

    def loaded(self) -> np.ndarray:
        """After the load, untimed: each page's bytes as a row (K region, then V)."""
        for i in range(self.n):
            self.out[i] = self.pool.page(i).contiguous().view(self.torch.uint8).reshape(-1).numpy()
        return self.out

    def close(self) -> None:
        if hasattr(self.backend, "close"):  # as SGLang's cache controller closes a backend
            self.backend.close()


class SglangStagingDriver(SglangDriver):
    """The same, the host pool in SGLang's default private memory: pages copied through staging."""

    shm = False


class SglangFileDriver(SglangDriver):
    """The same pages through SGLang's own file backend, its files under the directory given
    in place of an address, as SGLang's cache controller drives a backend that is not
    zero-copy: ``batch_set`` of the pages' flat copies, ``batch_get`` into empty flat pages
    then copied into the pool."""

    shm = False

    def _make_backend(self, address: str):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: PLC0415

        return StorageBackendFactory.create_backend("file", self._config({"file_storage_path": address}), self.pool)

    def put(self, keys: list, start: int, end: int) -> None:
        idx = self._indices(start, end)
        pages = [self.pool.get_data_page(idx[i * BLOCK_TOKENS]) for i in range(len(keys))]
        if not self.backend.batch_set(keys, pages):
            raise RuntimeError("SGLang's file backend: batch_set failed (see SGLang's log)")

    def get(self, keys: list, start: int, end: int) -> None:
        idx = self._indices(start, end)
        pages = self.backend.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(pages):
            if page is None:
                raise RuntimeError(f"SGLang's file backend: batch_get found no page for {keys[i]}")
            self.pool.set_from_flat_data_page(idx[i * BLOCK_TOKENS], page)


DRIVERS = {"vllm": VllmDriver, "sglang": SglangDriver, "vllm-staging": VllmStagingDriver,
           "sglang-staging": SglangStagingDriver}
ENGINE_DRIVERS = {"vllm": VllmFsDriver, "sglang": SglangFileDriver}


# ---------------------------------------------------------------- the run


def measure(adapter: str, tier: str, sync: str, rows: np.ndarray, root: Path, memcpy: float,
            scratch: np.ndarray) -> list[Row]:
    """Store and load ``rows`` through ``adapter`` against a daemon of its own with that
    tier and --sync policy; its rows, and the disk's beside that daemon's directory.
    ``scratch``: the run's memcpy destination, as large as ``rows`` (:func:`_timed_loads`)."""
    from kvdrive.layout.format import DATA_FILE  # noqa: PLC0415
    from kvdrive.tools.bench_store import SEQ_IO_BYTES, SequentialReader  # noqa: PLC0415
    from kvdrive_client.embedded import EmbeddedDaemon  # noqa: PLC0415

    n, nbytes = len(rows), rows.nbytes
    dram = str(int(nbytes * 1.25) + (64 << 20)) if tier == "dram" else "0"
    daemon = EmbeddedDaemon(dram=dram, ssd_max=str(nbytes * 2 + (1 << 30)), root=root,
                            extra_args=["--io-threads", "8", "--log-level", "WARNING", "--sync", sync])
    out, writes = np.zeros_like(rows), []
    try:
        from kvdrive_client import StoreClient  # noqa: PLC0415

        probe = StoreClient(daemon.address, timeout=60.0)
        daemon.wait_ready(lambda: probe.ping(timeout=0.5))
        direct = probe.server_info.get("direct_io")
        probe.close()
        driver = DRIVERS[adapter](daemon.address, rows, out)
        opened = f"; adapter opened in {driver.open_s * 1e3:.0f} ms, untimed" if driver.open_s is not None else ""
        try:
            writes.append(_disk_seq_write(daemon.root, nbytes))
            store_s, _ = _timed(driver.store)
            writes.append(_disk_seq_write(daemon.root, nbytes))
            loads, load_memcpy = _timed_loads(driver, f"{adapter} over the {tier} tier ({sync})", rows, scratch)
        finally:
            driver.close()
        if not direct:
            raise RuntimeError(f"{root} does not support O_DIRECT: SSD reads would hit the page cache")
        reader = SequentialReader(daemon.root / "ssd" / DATA_FILE, io_bytes=min(SEQ_IO_BYTES, nbytes))
        try:
            reads = [reader.read(0, nbytes) for _ in range(2)]
        finally:
            reader.close()
        disk = nbytes / min(reads) / 1e9
        writes.append(_disk_seq_write(daemon.root, nbytes))
    finally:
        daemon.stop()
    disk_write = statistics.median(writes)
    rows_out = []
    for op, secs in (("store", store_s), ("load", statistics.median(loads))):
        gbps = nbytes / secs / 1e9
        rows_out.append(Row(adapter, tier, op, n, secs, gbps, gbps / memcpy, gbps / disk,
                            gbps / disk_write if op == "store" else None, sync=sync))
    rows_out[1] = _load_row(rows_out[1], loads, nbytes, load_memcpy)
    _note(f"  {adapter} over the {tier} tier, {sync}: store {rows_out[0].gbps:.2f} GB/s, load {rows_out[1].gbps:.2f} "
          f"GB/s (disk sequential read {disk:.2f} GB/s, write {disk_write:.2f} GB/s of "
          f"{', '.join(f'{w:.2f}' for w in writes)}{opened})")
    rows_out.append(Row(adapter, tier, "disk seq read", n, nbytes / disk / 1e9, disk, disk / memcpy, 1.0, sync=sync))
    rows_out.append(Row(adapter, tier, "disk seq write", n, nbytes / disk_write / 1e9, disk_write, disk_write / memcpy,
                        disk_write / disk, 1.0, sync=sync, gbps_min=min(writes), gbps_max=max(writes)))
    return rows_out


def measure_engine(adapter: str, rows: np.ndarray, root: Path, memcpy: float, scratch: np.ndarray) -> list[Row]:
    """Store and load ``rows`` through the engine's own backend, driven as ``adapter``'s
    driver drives ours, its files in a fresh directory under ``root`` (removed after);
    ``scratch`` as :func:`measure` takes it."""
    where = Path(tempfile.mkdtemp(prefix=f"bench-tier-{adapter}-", dir=root))
    n, nbytes, name = len(rows), rows.nbytes, ENGINE_OWN[adapter]
    try:
        driver = ENGINE_DRIVERS[adapter](str(where), rows, np.zeros_like(rows))
        try:
            os.sync()
            store_s, _ = _timed(driver.store)
            os.sync()
            loads, load_memcpy = _timed_loads(driver, name, rows, scratch)
        finally:
            driver.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    rows_out = [Row(adapter, "fs", op, n, secs, nbytes / secs / 1e9, nbytes / secs / 1e9 / memcpy, None,
                    backend=name, sync="none") for op, secs in (("store", store_s), ("load", statistics.median(loads)))]
    rows_out[1] = _load_row(rows_out[1], loads, nbytes, load_memcpy)
    _note(f"  {name}: store {rows_out[0].gbps:.2f} GB/s, load {rows_out[1].gbps:.2f} GB/s{_io_path(adapter)}")
    return rows_out


def _io_path(adapter: str) -> str:
    """For vLLM's fs tier: which of its two I/O paths ran (its C extension is built against
    CUDA and does not load on a host without it; the Python path writes the same files)."""
    if adapter != "vllm":
        return ""
    from vllm.v1.kv_offload.tiering.fs import io  # noqa: PLC0415

    return " (vLLM's C I/O path)" if io._HAS_FSIO_C else " (vLLM's Python I/O path: its C extension did not load)"


def _size(text: str) -> int:
    from kvstored.config import parse_size  # noqa: PLC0415

    return parse_size(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=None, help=f"blocks per adapter (default {DEFAULT_BLOCKS}, "
                                                            f"{QUICK_BLOCKS} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_BLOCKS} blocks, {QUICK_ROUNDS} rounds of loads during stores, fill of 10 x "
                        f"{QUICK_FILL_DRAM >> 20} MiB")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["rate", "contention"],
                   help="comma-separated, of rate (store and load GB/s), contention (a load's latency alone and "
                        "during stores), fill (store throughput of the first and last tenth of 10 x the DRAM tier) "
                        "(default rate,contention)")
    p.add_argument("--adapters", type=lambda s: s.split(","), default=list(DEFAULT_ADAPTERS),
                   help="comma-separated, of " + ", ".join(ADAPTERS) + " (default vllm,sglang, each moved in place; "
                        "vllm-staging is vLLM's tier with zero_copy off, sglang-staging SGLang's host pool in its "
                        "default private memory: their blocks copied through staging, to compare)")
    p.add_argument("--tiers", type=lambda s: s.split(","), default=list(TIERS),
                   help="comma-separated, of dram (every block in the DRAM tier), ssd (DRAM tier off) (default both)")
    p.add_argument("--sync", type=lambda s: s.split(","), default=list(SYNCS),
                   help="rate: comma-separated, the daemons' --sync policies, of durable (a store acknowledged once "
                        "on the SSD), write-behind (acknowledged before the fsync, flushed within a second) "
                        "(default both)")
    p.add_argument("--no-baselines", action="store_true",
                   help="rate: leave out the engines' own backends (vLLM's fs tier, SGLang's file backend)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"contention: rounds of loads alone then during stores (default {DEFAULT_ROUNDS}, "
                        f"{QUICK_ROUNDS} with --quick)")
    p.add_argument("--loads", type=int, default=LOADS_PER_ROUND, help="contention: loads per side per round")
    p.add_argument("--fill-dram", type=_size, default=None,
                   help=f"fill: the daemon's DRAM tier (default {DEFAULT_FILL_DRAM >> 20}M, "
                        f"{QUICK_FILL_DRAM >> 20}M with --quick)")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help=f"layers per block: blocks of layers x {LAYER_BYTES >> 10} KiB (default {LAYERS}: "
                        f"{BLOCK_BYTES >> 20} MiB; 1 gives 64 KiB blocks)")
    p.add_argument("--dir", type=work_dir, default=None,
                   help="where the daemons' directories and the engines' own backends' files go (default: the temp "
                        "dir; it must take O_DIRECT; made if missing)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    from kvdrive.tools import bench_tier_stress as stress  # noqa: PLC0415
    from kvdrive.tools.engines import put_on_path  # noqa: PLC0415

    n = args.blocks or (QUICK_BLOCKS if args.quick else DEFAULT_BLOCKS)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    fill_dram = args.fill_dram or (QUICK_FILL_DRAM if args.quick else DEFAULT_FILL_DRAM)
    unknown = ([a for a in args.adapters if a not in ADAPTERS] + [t for t in args.tiers if t not in TIERS]
               + [s for s in args.sync if s not in SYNCS] + [m for m in args.modes if m not in MODES])
    if unknown or n < 1 or rounds < 1 or args.loads < 1 or args.layers < 1:
        print(f"kvdrive-bench tier: unknown adapter, tier, sync or mode {unknown}, or --blocks, --rounds, --loads or "
              f"--layers below 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for adapter in args.adapters:
        put_on_path(engine_of(adapter))
    root = args.dir or Path(tempfile.gettempdir())
    block_bytes = LAYER_BYTES * args.layers
    stressed = bool({"contention", "fill"} & set(args.modes))
    made = max(n if "rate" in args.modes else 0, 2 * JOB_BLOCKS if stressed else 0)  # the stress modes take 64
    _note(f"tier: {made} blocks of {block_bytes >> 10} KiB (Llama-3-8B's 16 tokens, {args.layers} layers) per "
          f"adapter: {made * block_bytes / 2**30:.2f} GiB")
    rows = np.frombuffer(bytearray(np.random.default_rng(0).bytes(made * block_bytes)),
                         dtype=np.uint8).reshape(made, block_bytes)
    report: dict = {}
    if "rate" in args.modes:
        report.update(_rates(args, rows[:n], root))
    if "contention" in args.modes:
        found = [stress.contention(a, rows, root, rounds, args.loads) for a in args.adapters]
        report["contention"] = [asdict(r) for r in found]
        header = ("adapter", "loads", "p50 alone ms", "p99 alone ms", "p50 during ms", "p99 during ms",
                  "p99 during / alone", "stores meanwhile GB/s")
        print(f"A cache-hit load of {JOB_BLOCKS} blocks ({JOB_BLOCKS * block_bytes >> 10} KiB, DRAM tier) alone and "
              f"while the adapter stores fresh blocks, {rounds} alternating rounds of {args.loads} loads each; "
              f"target: p99 during / alone <= 2")
        print("\n".join(text_table(header, [(r.adapter, str(r.loads), f"{r.p50_alone_ms:.1f}", f"{r.p99_alone_ms:.1f}",
                                             f"{r.p50_during_ms:.1f}", f"{r.p99_during_ms:.1f}", f"{r.p99_ratio:.2f}",
                                             f"{r.store_gbps_during:.2f}") for r in found])))
    if "fill" in args.modes:
        found = [stress.fill(a, rows, root, fill_dram) for a in args.adapters]
        report["fill"] = [asdict(r) for r in found]
        header = ("adapter", "DRAM tier MiB", "stored GiB", "first tenth GB/s", "last tenth GB/s", "last / first")
        print(f"Stores of fresh blocks until {stress.FILL_TIMES} x the DRAM tier, jobs of {JOB_BLOCKS} one after "
              f"another; store throughput of the first tenth of the blocks and of the last")
        print("\n".join(text_table(header, [(r.adapter, str(r.dram_bytes >> 20), f"{r.stored_bytes / 2**30:.2f}",
                                             f"{r.first_tenth_gbps:.2f}", f"{r.last_tenth_gbps:.2f}",
                                             f"{r.ratio:.2f}") for r in found])))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _rates(args: argparse.Namespace, rows: np.ndarray, root: Path) -> dict:
    n = len(rows)
    scratch = np.empty_like(rows)  # every memcpy's destination, the loads' own too
    memcpy = _memcpy_gbps(rows, scratch)
    _note(f"  memcpy here: {memcpy:.2f} GB/s")
    out: list[Row] = []
    for adapter in args.adapters:
        if not args.no_baselines and adapter in ENGINE_DRIVERS:
            out += measure_engine(adapter, rows, root, memcpy, scratch)
        for tier in args.tiers:
            for sync in args.sync:
                out += measure(adapter, tier, sync, rows, root, memcpy, scratch)
    _against_engine(out)
    targets = _targets(out)
    header = ("adapter", "backend", "tier", "op", "blocks", "s", "GB/s", "range GB/s", "vs memcpy", "vs disk seq read",
              "vs disk seq write", "vs engine's own")
    body = [(r.adapter, r.backend if r.backend != "kvdrive" else f"kvdrive {r.sync}", r.tier, r.op, str(r.blocks),
             f"{r.seconds:.2f}", f"{r.gbps:.2f}", "-" if r.gbps_min is None else f"{r.gbps_min:.2f}-{r.gbps_max:.2f}",
             f"{r.vs_memcpy:.3f}", _ratio(r.vs_disk_seq), _ratio(r.vs_disk_write), _ratio(r.vs_engine)) for r in out]
    print(f"{n} blocks of {rows.shape[1] >> 10} KiB (Llama-3-8B's 16-token block, {rows.shape[1] // LAYER_BYTES} "
          f"layers) through each adapter and through each engine's own backend; memcpy here {memcpy:.2f} GB/s")
    print("\n".join(text_table(header, body)))
    print("kvdrive durable / write-behind: the daemon's --sync (a store acknowledged once on the SSD / before the "
          "fsync, flushed within a second); vllm fs tier, sglang file: the engines' own backends, files under --dir, "
          "never fsynced")
    print("vs disk seq read: against sequential O_DIRECT reads of that daemon's data file, measured after its loads")
    print(f"disk seq write: as many bytes written sequentially (O_DIRECT, 2 MiB writes, one fdatasync) beside that "
          f"daemon's directory, {DISK_WRITES} times (before the stores, after them, after the loads); GB/s and every "
          f"ratio to it take the median, range GB/s is the lowest to the highest")
    print(f"load: every block loaded {LOAD_PASSES} times, the pool zeroed before each and checked after; GB/s and "
          f"every ratio take the median pass, range GB/s is the slowest to the fastest; vs memcpy: against the median "
          f"of {LOAD_PASSES} memcpys of as many bytes, one after each pass")
    print("vs engine's own: against the same op through that engine's own backend")
    for t in targets:
        print(f"{t['what']}: {t['ratio']:.3f}x (target >= {t['target']:.1f}: {'met' if t['met'] else 'missed'})")
    return {"memcpy_gbps": memcpy, "rows": [asdict(r) for r in out], "targets": targets}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _against_engine(rows: list[Row]) -> None:
    """Set each KVDrive store's and load's ``vs_engine``: against the same op through the
    engine's own backend, where that ran."""
    own = {(r.adapter, r.op): r.gbps for r in rows if r.backend != "kvdrive"}
    for r in rows:
        if r.backend == "kvdrive" and (engine_of(r.adapter), r.op) in own:
            r.vs_engine = r.gbps / own[engine_of(r.adapter), r.op]


def _targets(rows: list[Row]) -> list[dict]:
    """The ratios the bench is judged by, per adapter and tier: the write-behind store
    against the engine's own store, the durable store against the disk's durable write,
    a load from the DRAM tier against a memcpy."""
    found = []
    for r in rows:
        if r.backend != "kvdrive" or r.op != "store":
            continue
        if r.sync == "write-behind" and r.vs_engine is not None:
            own = ENGINE_OWN[engine_of(r.adapter)]
            found.append({"adapter": r.adapter, "tier": r.tier, "sync": r.sync, "op": "store", "against": own,
                          "ratio": r.vs_engine, "target": WRITE_BEHIND_TARGET,
                          "what": f"{r.adapter} {r.tier} write-behind store / {own} store"})
        elif r.sync == "durable":
            disk = next(d for d in rows if d.op == "disk seq write" and (d.adapter, d.tier, d.sync, d.backend) ==
                        (r.adapter, r.tier, r.sync, r.backend))
            found.append({"adapter": r.adapter, "tier": r.tier, "sync": r.sync, "op": "store", "against": "disk seq write",
                          "ratio": r.vs_disk_write, "target": DURABLE_TARGET,
                          "what": f"{r.adapter} {r.tier} durable store / disk seq write (median {disk.gbps:.2f} GB/s, "
                                  f"range {disk.gbps_min:.2f}-{disk.gbps_max:.2f})"})
    for r in rows:
        if r.backend == "kvdrive" and r.op == "load" and r.tier == "dram":
            found.append({"adapter": r.adapter, "tier": r.tier, "sync": r.sync, "op": "load", "against": "memcpy",
                          "ratio": r.vs_memcpy, "target": LOAD_TARGET,
                          "what": f"{r.adapter} dram load ({r.sync}) / memcpy"})
    for t in found:
        t["met"] = t["ratio"] >= t["target"]
    return found
