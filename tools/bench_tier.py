"""``kvdrive-bench tier``: the serving engines' adapters moving KV blocks through kvstored.

Blocks have Llama-3-8B's shape: 16 tokens x 32 layers x 8 KV heads x head dim 128, K and
V, 16-bit: 2 MiB each. Through each adapter (vLLM's ``KVDriveTier``, SGLang's
``KVDriveHiCacheStorage``, driven as their engines drive them: vLLM's store and load jobs
of 32 blocks polled through ``get_finished_jobs``, SGLang's ``batch_set_v1`` /
``batch_get_v1`` of 32 pages), ``--blocks`` blocks are stored and loaded back against a
real kvstored in two set-ups: the DRAM tier holding every block, and the DRAM tier off
(every load reads the SSD, O_DIRECT). Each adapter and tier gets a daemon of its own.

Every figure is GB/s of block bytes, beside baselines measured in the same run: a plain
memcpy of as many bytes here, sequential O_DIRECT reads of the daemon's own data file
(the disk's sequential read) and, for stores, as many bytes written sequentially with
O_DIRECT and one fdatasync beside it (the disk's sequential durable write). Loaded bytes are checked against the stored
bytes; a mismatch fails the run. Stores are durable (acknowledged once on the SSD).

That is ``--modes rate``; ``contention`` (on by default) and ``fill`` are in
:mod:`kvdrive.tools.bench_tier_stress`: a cache-hit load's latency alone and during
stores, and the store throughput of the first and the last tenth of ten times the
daemon's DRAM tier.

The engines are not installed with KVDrive: their pinned packages are installed once per
machine without dependencies (:mod:`kvdrive.tools.engines`).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvdrive.tools.text_table import text_table

BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, ITEM = 16, 32, 8, 128, 2
LAYER_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2 * ITEM  # one layer's K and V of a block: 64 KiB
BLOCK_BYTES = LAYER_BYTES * LAYERS  # the default block: 2 MiB
DEFAULT_BLOCKS, QUICK_BLOCKS = 1000, 64
JOB_BLOCKS = 32
MODES = ("rate", "contention", "fill")
DEFAULT_ROUNDS, QUICK_ROUNDS, LOADS_PER_ROUND = 10, 4, 10
DEFAULT_FILL_DRAM, QUICK_FILL_DRAM = 256 << 20, 64 << 20
ADAPTERS = ("vllm", "sglang")
TIERS = ("dram", "ssd")


@dataclass
class Row:
    adapter: str
    tier: str
    op: str
    blocks: int
    seconds: float
    gbps: float
    vs_memcpy: float
    vs_disk_seq: float
    vs_disk_write: float | None = None  # stores: against the disk's sequential durable write


def _disk_seq_write(directory: Path, nbytes: int, io_bytes: int = BLOCK_BYTES) -> float:
    """GB/s of writing ``nbytes`` sequentially to a new file in ``directory``, O_DIRECT in
    ``io_bytes`` writes, then fdatasync (what a durable store must at least wait for)."""
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


# ---------------------------------------------------------------- the two adapters, as their engines drive them


class VllmDriver:
    """vLLM's tiering manager's side: jobs of ``JOB_BLOCKS`` chunks, results polled."""

    def __init__(self, address: str, rows: np.ndarray, out: np.ndarray) -> None:
        from kvdrive_client.integrations.vllm import KVDriveTier  # noqa: PLC0415 - needs vLLM on the path
        from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415
        from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: PLC0415

        self.n = len(rows)
        self._job, self._ctx = TransferJob, ReqContext(req_id="bench")
        spec = SimpleNamespace(config=None)
        # Stores read the source rows; loads land in the second half of one CPU tier.
        self.primary = np.concatenate([rows, out])
        self.tier = KVDriveTier(spec, memoryview(self.primary), "KVDriveTier", address=address, model="llama-3-8b",
                                timeout=600.0)
        self.keys = [b"bench" + i.to_bytes(8, "little") for i in range(self.n)]
        self._next_job = 0

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
                raise RuntimeError(f"vLLM job {r.job_id} failed: {self.tier.stats()}")
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

    def load(self) -> np.ndarray:
        self._run(promotion=True)
        return self.primary[self.n:]

    def close(self) -> None:
        self.tier.shutdown()


class SglangDriver:
    """SGLang's cache controller's side: ``batch_set_v1`` / ``batch_get_v1`` of ``JOB_BLOCKS``
    pages, host indices into a host pool with SGLang's page_first layout."""

    def __init__(self, address: str, rows: np.ndarray, out: np.ndarray) -> None:
        import torch  # noqa: PLC0415
        from kvdrive.tools.engines import PageFirstHostPool  # noqa: PLC0415
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: PLC0415
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: PLC0415

        self.n, self.torch, self.out = len(rows), torch, out
        self.pool = PageFirstHostPool(self.n, BLOCK_TOKENS, rows.shape[1] // LAYER_BYTES, KV_HEADS, HEAD_DIM,
                                      torch.bfloat16)
        half = rows.shape[1] // 2
        for i, row in enumerate(rows):  # page i holds block i's bytes: its K region, then its V region
            page = self.pool.page(i)
            for kv in (0, 1):
                page[kv].view(torch.uint8).view(-1)[:] = torch.from_numpy(row[kv * half: (kv + 1) * half])
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="llama-3-8b",
            extra_config={"backend_name": "kvdrive", "module_path": "kvdrive_client.integrations.sglang",
                          "class_name": "KVDriveHiCacheStorage", "interface_v1": 1, "address": address,
                          "timeout": 600.0})
        self.backend = StorageBackendFactory.create_backend("dynamic", cfg, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.keys = [f"{i:064x}" for i in range(self.n)]

    def _indices(self, start: int, end: int):
        return self.torch.arange(start * BLOCK_TOKENS, end * BLOCK_TOKENS, dtype=self.torch.int64)

    def put(self, keys: list, start: int, end: int) -> None:
        """``batch_set_v1`` of ``keys`` from host pages ``start`` to ``end``."""
        if not all(self.backend.batch_set_v1(keys, self._indices(start, end))):
            raise RuntimeError(f"SGLang batch_set_v1 failed: {self.backend.stats()}")

    def get(self, keys: list, start: int, end: int) -> None:
        """``batch_get_v1`` of ``keys`` into host pages ``start`` to ``end``."""
        if not all(self.backend.batch_get_v1(keys, self._indices(start, end))):
            raise RuntimeError(f"SGLang batch_get_v1 failed: {self.backend.stats()}")

    def store(self) -> None:
        for start in range(0, self.n, JOB_BLOCKS):
            end = min(start + JOB_BLOCKS, self.n)
            self.put(self.keys[start:end], start, end)

    def load(self) -> np.ndarray:
        self.pool.kv_buffer.zero_()
        for start in range(0, self.n, JOB_BLOCKS):
            end = min(start + JOB_BLOCKS, self.n)
            self.get(self.keys[start:end], start, end)
        for i in range(self.n):
            self.out[i] = self.pool.page(i).contiguous().view(self.torch.uint8).reshape(-1).numpy()
        return self.out

    def close(self) -> None:
        self.backend.close()


DRIVERS = {"vllm": VllmDriver, "sglang": SglangDriver}


# ---------------------------------------------------------------- the run


def measure(adapter: str, tier: str, rows: np.ndarray, root: Path, memcpy: float) -> list[Row]:
    from kvdrive.layout.format import DATA_FILE  # noqa: PLC0415
    from kvdrive.tools.bench_store import SequentialReader  # noqa: PLC0415
    from kvdrive_client.embedded import EmbeddedDaemon  # noqa: PLC0415

    n, nbytes = len(rows), rows.nbytes
    dram = str(int(nbytes * 1.25) + (64 << 20)) if tier == "dram" else "0"
    daemon = EmbeddedDaemon(dram=dram, ssd_max=str(nbytes * 2 + (1 << 30)), root=root,
                            extra_args=["--io-threads", "8", "--log-level", "WARNING"])
    out = np.zeros_like(rows)
    try:
        from kvdrive_client import StoreClient  # noqa: PLC0415

        probe = StoreClient(daemon.address, timeout=60.0)
        daemon.wait_ready(lambda: probe.ping(timeout=0.5))
        direct = probe.server_info.get("direct_io")
        probe.close()
        driver = DRIVERS[adapter](daemon.address, rows, out)
        try:
            t0 = time.perf_counter()
            driver.store()
            store_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            loaded = driver.load()
            load_s = time.perf_counter() - t0
            bad = int((loaded != rows).any(axis=1).sum())
            if bad:
                raise RuntimeError(f"{adapter} over the {tier} tier loaded {bad} of {n} blocks with other bytes")
        finally:
            driver.close()
        if not direct:
            raise RuntimeError(f"{root} does not support O_DIRECT: SSD reads would hit the page cache")
        reader = SequentialReader(daemon.root / "ssd" / DATA_FILE)
        try:
            reads = [reader.read(0, nbytes) for _ in range(2)]
        finally:
            reader.close()
        disk = nbytes / min(reads) / 1e9
        disk_write = _disk_seq_write(daemon.root, nbytes)
    finally:
        daemon.stop()
    rows_out = []
    for op, secs in (("store", store_s), ("load", load_s)):
        gbps = nbytes / secs / 1e9
        rows_out.append(Row(adapter, tier, op, n, secs, gbps, gbps / memcpy, gbps / disk,
                            gbps / disk_write if op == "store" else None))
    _note(f"  {adapter} over the {tier} tier: store {rows_out[0].gbps:.2f} GB/s, load {rows_out[1].gbps:.2f} GB/s "
          f"(disk sequential read {disk:.2f} GB/s, write {disk_write:.2f} GB/s)")
    rows_out.append(Row(adapter, tier, "disk seq read", n, nbytes / disk / 1e9, disk, disk / memcpy, 1.0))
    rows_out.append(Row(adapter, tier, "disk seq write", n, nbytes / disk_write / 1e9, disk_write, disk_write / memcpy,
                        disk_write / disk, 1.0))
    return rows_out


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
    p.add_argument("--adapters", type=lambda s: s.split(","), default=list(ADAPTERS),
                   help="comma-separated, of " + ", ".join(ADAPTERS) + " (default both)")
    p.add_argument("--tiers", type=lambda s: s.split(","), default=list(TIERS),
                   help="comma-separated, of dram (every block in the DRAM tier), ssd (DRAM tier off) (default both)")
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
    p.add_argument("--dir", type=Path, default=None,
                   help="where the daemons' directories go (default: the temp dir; it must take O_DIRECT)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    from kvdrive.tools import bench_tier_stress as stress  # noqa: PLC0415
    from kvdrive.tools.engines import put_on_path  # noqa: PLC0415

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    n = args.blocks or (QUICK_BLOCKS if args.quick else DEFAULT_BLOCKS)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    fill_dram = args.fill_dram or (QUICK_FILL_DRAM if args.quick else DEFAULT_FILL_DRAM)
    unknown = ([a for a in args.adapters if a not in ADAPTERS] + [t for t in args.tiers if t not in TIERS]
               + [m for m in args.modes if m not in MODES])
    if unknown or n < 1 or rounds < 1 or args.loads < 1 or args.layers < 1:
        print(f"kvdrive-bench tier: unknown adapter, tier or mode {unknown}, or --blocks, --rounds, --loads or "
              f"--layers below 1", file=sys.stderr)
        return 2
    for adapter in args.adapters:
        put_on_path(adapter)
    root = args.dir or Path(tempfile.gettempdir())
    block_bytes = LAYER_BYTES * args.layers
    _note(f"tier: {n} blocks of {block_bytes >> 10} KiB (Llama-3-8B's 16 tokens, {args.layers} layers) per adapter: "
          f"{n * block_bytes / 2**30:.2f} GiB")
    made = max(n, 2 * JOB_BLOCKS) if {"contention", "fill"} & set(args.modes) else n  # the stress modes take 64
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
    memcpy = _memcpy_gbps(rows, np.empty_like(rows))
    _note(f"  memcpy here: {memcpy:.2f} GB/s")
    out: list[Row] = []
    for tier in args.tiers:
        for adapter in args.adapters:
            out += measure(adapter, tier, rows, root, memcpy)
    header = ["adapter", "tier", "op", "blocks", "s", "GB/s", "vs memcpy", "vs disk seq read", "vs disk seq write"]
    body = [[r.adapter, r.tier, r.op, str(r.blocks), f"{r.seconds:.2f}", f"{r.gbps:.2f}", f"{r.vs_memcpy:.3f}",
             f"{r.vs_disk_seq:.3f}", "-" if r.vs_disk_write is None else f"{r.vs_disk_write:.3f}"] for r in out]
    print(f"{n} blocks of {rows.shape[1] >> 10} KiB (Llama-3-8B's 16-token block, {rows.shape[1] // LAYER_BYTES} "
          f"layers) through each adapter; "
          f"memcpy here {memcpy:.2f} GB/s; stores durable")
    print("\n".join(text_table(tuple(header), [tuple(r) for r in body])))
    print("vs disk seq read: against sequential O_DIRECT reads of that daemon's data file, measured after its loads; "
          "vs disk seq write: stores against as many bytes written sequentially (O_DIRECT, 2 MiB writes, one "
          "fdatasync) beside that daemon's directory")
    return {"memcpy_gbps": memcpy, "rows": [asdict(r) for r in out]}
