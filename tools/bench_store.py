"""``kvdrive-bench store``: kvstored's data path against this machine's own limits.

One run prints one table. Every ratio divides two numbers measured side by side in
that run (interleaved repeats, medians), never numbers from another run.

The sequence has Llama-3-8B's KV geometry (32 layers x 8 KV heads x head dim 128,
fp16, 16-token pages: 8 KiB blocks); 32K tokens are 4 GiB. ``--layers`` and
``--tokens`` shrink it. Each store-backed case talks to a real kvstored process
started in a temporary directory under ``--dir`` and removed afterwards.

- dram: every block resident in the DRAM tier; each get asks for a random 6.25% of
  all blocks in one request, landing in a registered shared buffer (zero-copy).
  Baseline: a numpy copy of as many bytes between two pre-faulted buffers here.
- ssd: DRAM tier off (``--dram 0``), O_DIRECT reads. Each (layer, head) partition's
  pages are dealt into clusters at random (clusters are semantic, not positional);
  a get takes whole clusters, 6.25% of every partition's pages. The same selection
  is read from a sequence put with its cluster ids (semantic-contiguous packing) and
  from one put without (token order). Second baseline: sequential O_DIRECT reads of
  the daemon's data file, 4 MiB each, on the daemon's I/O thread count.
- rtt: one-block gets, one at a time, against the bare HELLO round trip.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from kvdrive.layout.format import DATA_FILE
from kvdrive.layout.geometry import Geometry
from kvdrive.tools.cli_paths import output_file, work_dir
from kvdrive.tools.targets import TARGET_DRAM_VS_MEMCPY, TARGET_PACKED_VS_SEQ, TARGET_PACKED_VS_TOKEN, verdict
from kvdrive_client import StoreClient
from kvdrive_client.embedded import EmbeddedDaemon
from kvdrive_client.shm import SharedBuffer
from kvstored.protocol import Op

# Llama-3-8B's KV cache: 32 layers, 8 KV heads, head dim 128, fp16.
MODEL_LAYERS, MODEL_KV_HEADS, MODEL_HEAD_DIM = 32, 8, 128
PAGE_SIZE = 16
DEFAULT_TOKENS = 32768
BUDGET = 1 / 16  # fraction of blocks a sparse get selects (6.25%)
CLUSTERS = 64  # index clusters per (layer, head) partition
IO_THREADS = 8  # the daemon's --io-threads, and the sequential reader's threads
SEQ_IO_BYTES = 4 << 20
SEQ_READ_BYTES = 1 << 30


@dataclass(frozen=True)
class BenchConfig:
    layers: int
    tokens: int
    repeats: int
    rtt_iters: int
    root: Path
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.layers <= MODEL_LAYERS:
            raise ValueError(f"--layers must be in 1..{MODEL_LAYERS}, got {self.layers}")
        if self.tokens % PAGE_SIZE or self.tokens // PAGE_SIZE < CLUSTERS:
            raise ValueError(f"--tokens must be a multiple of {PAGE_SIZE} and at least {CLUSTERS * PAGE_SIZE}, got {self.tokens}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if not self.root.is_dir():
            raise ValueError(f"--dir {self.root} is not a directory")

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.layers, MODEL_KV_HEADS, MODEL_HEAD_DIM, "float16", PAGE_SIZE)

    @property
    def pages(self) -> int:
        return self.tokens // PAGE_SIZE

    @property
    def num_blocks(self) -> int:
        return self.layers * MODEL_KV_HEADS * self.pages

    @property
    def layer_bytes(self) -> int:
        return MODEL_KV_HEADS * self.pages * self.geometry.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes


@dataclass
class Row:
    case: str
    nbytes: int
    gb_per_s: float
    baseline: float
    baseline_name: str
    target: float | None
    ios: str = "-"
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.gb_per_s / self.baseline

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "(no target)"
        return verdict(self.ratio >= self.target)

    def to_json(self) -> dict:
        return {"case": self.case, "bytes": self.nbytes, "gb_per_s": self.gb_per_s, "baseline": self.baseline,
                "ratio": self.ratio, "baseline_name": self.baseline_name, "target": self.target,
                "result": self.verdict, **self.extra}


# ---------------------------------------------------------------- data


class SyntheticKV:
    """Reproducible blocks: one random layer image, every block stamped with its address.

    The first 8 bytes of a block hold ``layer << 40 | head << 24 | page``, so a get
    that returns a block of the wrong address, or stale bytes, fails :meth:`check`.
    """

    def __init__(self, cfg: BenchConfig, rng: np.random.Generator) -> None:
        self.pages = cfg.pages
        self.bb = cfg.geometry.block_bytes
        self.base = np.frombuffer(rng.bytes(cfg.layer_bytes), dtype=np.uint8).reshape(-1, self.bb)
        heads, pages = np.divmod(np.arange(len(self.base)), self.pages)
        self._heads, self._pages = heads, pages

    @staticmethod
    def stamps(layers: np.ndarray, heads: np.ndarray, pages: np.ndarray) -> np.ndarray:
        code = (layers.astype(np.uint64) << np.uint64(40)) | (heads.astype(np.uint64) << np.uint64(24)) | pages.astype(np.uint64)
        return code.astype("<u8").view(np.uint8).reshape(-1, 8)

    def fill(self, layer: int, out: np.ndarray) -> None:
        out[:] = self.base
        out[:, :8] = self.stamps(np.full(len(out), layer), self._heads, self._pages)

    def check(self, out: np.ndarray, blocks: np.ndarray) -> None:
        lay, hed, pag = blocks[:, 0], blocks[:, 1], blocks[:, 2]
        ok = np.array_equal(out[:, :8], self.stamps(lay, hed, pag))
        ok = ok and np.array_equal(out[:, 8:], self.base[hed.astype(np.int64) * self.pages + pag, 8:])
        if not ok:
            raise RuntimeError("a get returned bytes that differ from what was put; the numbers would be meaningless")


def random_blocks(rng: np.random.Generator, cfg: BenchConfig, count: int) -> np.ndarray:
    flat = rng.choice(cfg.num_blocks, count, replace=False)
    return np.stack(np.unravel_index(flat, (cfg.layers, MODEL_KV_HEADS, cfg.pages)), axis=1).astype(np.int32)


def random_clusters(rng: np.random.Generator, cfg: BenchConfig) -> np.ndarray:
    """``[layers, heads, pages]`` cluster ids: each partition's pages dealt at random into equal clusters."""
    ranks = rng.permuted(np.tile(np.arange(cfg.pages), (cfg.layers * MODEL_KV_HEADS, 1)), axis=1)
    return (ranks * CLUSTERS // cfg.pages).astype(np.int32).reshape(cfg.layers, MODEL_KV_HEADS, cfg.pages)


CLUSTERS_PER_GET = max(1, round(CLUSTERS * BUDGET))


def cluster_selection(rng: np.random.Generator, cluster: np.ndarray) -> np.ndarray:
    """Blocks of ``CLUSTERS_PER_GET`` distinct random clusters in every partition."""
    per = CLUSTERS_PER_GET
    chosen = np.argsort(rng.random((*cluster.shape[:2], CLUSTERS)), axis=2)[:, :, :per]
    mask = (cluster[..., None] == chosen[:, :, None, :]).any(axis=-1)
    return np.stack(np.nonzero(mask), axis=1).astype(np.int32)


# ---------------------------------------------------------------- daemon and puts


@contextlib.contextmanager
def running_daemon(cfg: BenchConfig, dram_bytes: int, ssd_max_bytes: int) -> Iterator[tuple[StoreClient, Path]]:
    """A kvstored process in a fresh directory under ``cfg.root``; stopped and removed on exit."""
    daemon = EmbeddedDaemon(dram=str(dram_bytes), ssd_max=str(ssd_max_bytes), root=cfg.root,
                            extra_args=["--io-threads", str(IO_THREADS), "--log-level", "WARNING"])
    try:
        client = StoreClient(daemon.address, timeout=600.0, daemon=daemon)
    except BaseException:
        daemon.stop()
        raise
    try:
        daemon.wait_ready(lambda: client.ping(timeout=0.5))
        if not client.server_info.get("direct_io"):
            raise RuntimeError(f"--dir {cfg.root} does not support O_DIRECT: SSD reads would hit the page cache")
        yield client, daemon.root / "ssd" / DATA_FILE
    finally:
        client.close()  # stops the daemon and removes its directory


def put_sequence(client: StoreClient, cfg: BenchConfig, data: SyntheticKV, staging: SharedBuffer, name: str,
                 cluster: np.ndarray | None = None):
    """Put the whole sequence one layer at a time, as prefill produces it (durable puts)."""
    seq = client.create("bench", name, cfg.geometry)
    view = staging.array[: cfg.layer_bytes].reshape(-1, data.bb)
    t0 = time.perf_counter()
    for layer in range(cfg.layers):
        data.fill(layer, view)
        client.put_from(seq, [layer], range(cfg.pages), staging, 0, cluster=None if cluster is None else cluster[layer])
        done = (layer + 1) * cfg.layer_bytes
        _progress(f"put {name}: layer {layer + 1}/{cfg.layers}, {done / 2**20:.0f} MiB, "
                  f"{done / (time.perf_counter() - t0) / 1e6:.0f} MB/s", last=layer + 1 == cfg.layers)
    return seq


def _progress(text: str, last: bool = False) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r  {text}\x1b[K" + ("\n" if last else ""))
    elif last:
        sys.stderr.write(f"  {text}\n")
    sys.stderr.flush()


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- measurements


class SequentialReader:
    """Sequential O_DIRECT reads of a file, ``io_bytes`` each, strided over ``threads`` threads."""

    def __init__(self, path: Path, threads: int = IO_THREADS, io_bytes: int = SEQ_IO_BYTES) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        self.io_bytes = io_bytes
        self.size = os.fstat(self.fd).st_size // io_bytes * io_bytes
        if not self.size:
            raise ValueError(f"{path} is smaller than one {io_bytes} B read")
        self.threads = threads
        self._maps = [mmap.mmap(-1, io_bytes) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-seq")

    def _read(self, t: int, offsets: list[int]) -> None:
        buf = self._maps[t]
        for off in offsets[t :: self.threads]:
            got = os.preadv(self.fd, [buf], off)
            if got != self.io_bytes:
                raise OSError(f"short read at {off}: {got} of {self.io_bytes} bytes")

    def read(self, start: int, nbytes: int) -> float:
        """Seconds to read ``nbytes`` from ``start`` (wrapping at the end of the file)."""
        offsets = [(start + i * self.io_bytes) % self.size for i in range(max(1, nbytes // self.io_bytes))]
        t0 = time.perf_counter()
        for fut in [self._pool.submit(self._read, t, offsets) for t in range(self.threads)]:
            fut.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self.fd)
        for m in self._maps:
            m.close()


def _rates(nbytes: int, seconds: list[float]) -> list[float]:
    """GB/s of every repeat, for the JSON (the table shows medians)."""
    return _round([nbytes / s / 1e9 for s in seconds])


def _round(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


def timed_get(client: StoreClient, seq, blocks: np.ndarray, out: SharedBuffer) -> tuple[float, dict]:
    t0 = time.perf_counter()
    reply = client.get_into(seq, blocks, out)
    return time.perf_counter() - t0, reply


def bench_dram(client: StoreClient, cfg: BenchConfig, data: SyntheticKV, seq, out: SharedBuffer,
               rng: np.random.Generator) -> Row:
    count = round(cfg.num_blocks * BUDGET)
    nbytes = count * data.bb
    src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)  # written once: every page faulted in
    get_s, copy_s, daemon_ms, hits = [], [], [], []
    for r in range(cfg.repeats + 1):  # repeat 0 warms up (the daemon's first touch of the buffer) and verifies
        blocks = random_blocks(rng, cfg, count)
        dt, reply = timed_get(client, seq, blocks, out)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ct = time.perf_counter() - t0
        if r == 0:
            data.check(out.array[:nbytes].reshape(count, data.bb), blocks)
            continue
        get_s.append(dt), copy_s.append(ct), daemon_ms.append(reply["ms"]), hits.append(reply["dram"])
    if min(hits) < count:
        _note(f"warning: only {min(hits)} of {count} blocks came from the DRAM tier")
    return Row(f"dram sparse get ({BUDGET:.2%})", nbytes, nbytes / statistics.median(get_s) / 1e9,
               nbytes / statistics.median(copy_s) / 1e9, "memcpy", TARGET_DRAM_VS_MEMCPY,
               extra={"blocks": count, "dram_blocks": min(hits), "reads": 0, "daemon_ms": statistics.median(daemon_ms),
                      "samples": _rates(nbytes, get_s), "baseline_samples": _rates(nbytes, copy_s)})


def bench_ssd(client: StoreClient, cfg: BenchConfig, data: SyntheticKV, packed, token, cluster: np.ndarray,
              out: SharedBuffer, data_file: Path, rng: np.random.Generator) -> list[Row]:
    reader = SequentialReader(data_file)
    seq_bytes = min(SEQ_READ_BYTES, reader.size)
    # GB/s per repeat: with a page count that CLUSTERS does not divide, selections differ in size.
    rates: dict[str, list[float]] = {"packed": [], "token": [], "seq": []}
    replies: dict[str, list[dict]] = {"packed": [], "token": []}
    sizes = []
    try:
        for r in range(cfg.repeats + 1):
            blocks = cluster_selection(rng, cluster)
            nbytes = len(blocks) * data.bb
            for name, seq in (("packed", packed), ("token", token)):
                dt, reply = timed_get(client, seq, blocks, out)
                if r == 0:
                    data.check(out.array[:nbytes].reshape(-1, data.bb), blocks)
                    continue
                rates[name].append(nbytes / dt / 1e9), replies[name].append(reply)
            st = reader.read(r * seq_bytes % reader.size, seq_bytes)
            if r:
                rates["seq"].append(seq_bytes / st / 1e9), sizes.append(nbytes)
    finally:
        reader.close()
    for name, rs in replies.items():
        if any(x["ssd"] != x["n"] for x in rs):
            _note(f"warning: {name} gets were not served entirely from the SSD tier")
    nbytes = int(statistics.median(sizes))
    packed_bw, token_bw, seq_bw = (statistics.median(rates[k]) for k in ("packed", "token", "seq"))

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in replies[name])

    p_reads, t_reads = med("packed", "reads"), med("token", "reads")
    common = {"blocks": nbytes // data.bb, "reads": p_reads, "bytes_read": med("packed", "bytes_read"),
              "samples": _round(rates["packed"]),
              "daemon_ms": med("packed", "ms")}
    seq_ios = seq_bytes // SEQ_IO_BYTES
    return [
        Row("ssd packed get vs token-order", nbytes, packed_bw, token_bw, "token-order get", TARGET_PACKED_VS_TOKEN,
            f"{p_reads:.0f} vs {t_reads:.0f}",
            {**common, "baseline_reads": t_reads, "baseline_bytes_read": med("token", "bytes_read"),
             "baseline_samples": _round(rates["token"]),
             "baseline_daemon_ms": med("token", "ms")}),
        Row("ssd packed get vs sequential", nbytes, packed_bw, seq_bw, "sequential read", TARGET_PACKED_VS_SEQ,
            f"{p_reads:.0f} vs {seq_ios} x {SEQ_IO_BYTES >> 20} MiB",
            {**common, "baseline_reads": seq_ios, "baseline_bytes": seq_bytes, "baseline_samples": _round(rates["seq"])}),
    ]


def bench_rtt(client: StoreClient, cfg: BenchConfig, seq, out: SharedBuffer, rng: np.random.Generator) -> Row:
    bb = cfg.geometry.block_bytes
    flat = rng.integers(0, cfg.num_blocks, cfg.rtt_iters)
    blocks = np.stack(np.unravel_index(flat, (cfg.layers, MODEL_KV_HEADS, cfg.pages)), axis=1).astype(np.int32)[:, None, :]
    get_s, hello_s = [], []
    for r in range(cfg.repeats + 1):
        t0 = time.perf_counter()
        for _ in range(cfg.rtt_iters):
            client.call(Op.HELLO)
        t1 = time.perf_counter()
        for b in blocks:
            client.get_into(seq, b, out)
        t2 = time.perf_counter()
        if r:
            hello_s.append(t1 - t0), get_s.append(t2 - t1)
    get_rate = cfg.rtt_iters / statistics.median(get_s)
    hello_rate = cfg.rtt_iters / statistics.median(hello_s)
    return Row("1-block get vs hello round trip", bb, get_rate * bb / 1e9, hello_rate * bb / 1e9, "hello rtt", None,
               f"{get_rate:,.0f} vs {hello_rate:,.0f} op/s",
               {"ops_per_s": get_rate, "baseline_ops_per_s": hello_rate, "us_per_op": 1e6 / get_rate,
                "baseline_us_per_op": 1e6 / hello_rate})


# ---------------------------------------------------------------- the run


def run_store(cfg: BenchConfig) -> tuple[list[Row], dict]:
    rng = np.random.default_rng(cfg.seed)
    data = SyntheticKV(cfg, rng)
    sel_bytes = round(cfg.num_blocks * BUDGET) * data.bb
    info: dict = {}
    rows: list[Row] = []

    _note(f"DRAM tier: starting kvstored with --dram {cfg.total_bytes / 2**30:.2f} GiB + slack")
    with running_daemon(cfg, cfg.total_bytes + (64 << 20), cfg.total_bytes + (1 << 30)) as (client, _):
        info["server"] = client.server_info
        staging, out = client.register(cfg.layer_bytes), client.register(sel_bytes)
        t0 = time.perf_counter()
        seq = put_sequence(client, cfg, data, staging, "dram")
        info["put_dram_s"] = time.perf_counter() - t0
        _note("measuring DRAM-tier sparse gets vs memcpy")
        rows.append(bench_dram(client, cfg, data, seq, out, rng))
        _note("measuring single-block round trips")
        rtt = bench_rtt(client, cfg, seq, out, rng)

    _note("SSD tier: starting kvstored with --dram 0 (every block from SSD, O_DIRECT)")
    with running_daemon(cfg, 0, 2 * cfg.total_bytes + (1 << 30)) as (client, data_file):
        # Clusters hold ceil(pages / CLUSTERS) pages at most.
        most = cfg.layers * MODEL_KV_HEADS * CLUSTERS_PER_GET * -(-cfg.pages // CLUSTERS) * data.bb
        staging, out = client.register(cfg.layer_bytes), client.register(most)
        cluster = random_clusters(rng, cfg)
        t0 = time.perf_counter()
        packed = put_sequence(client, cfg, data, staging, "packed", cluster)
        token = put_sequence(client, cfg, data, staging, "token-order")
        info["put_ssd_s"] = time.perf_counter() - t0
        _note("measuring SSD-tier sparse gets (packed, token-order) and sequential reads")
        rows.extend(bench_ssd(client, cfg, data, packed, token, cluster, out, data_file, rng))
    rows.append(rtt)
    return rows, info


def render(rows: list[Row], cfg: BenchConfig, info: dict) -> str:
    g = cfg.geometry
    server = info.get("server", {})
    lines = [
        f"kvdrive-bench store: Llama-3-8B KV geometry: {g.num_layers} layers x {g.num_kv_heads} KV heads x head dim "
        f"{g.head_dim}, {g.dtype.value}, page {g.page_size} tokens -> {g.block_bytes // 1024} KiB blocks",
    ]
    if cfg.layers < MODEL_LAYERS:
        lines.append(f"NOTE: only {cfg.layers} of the model's {MODEL_LAYERS} layers (--layers/--quick); "
                     f"the full sequence would be {MODEL_LAYERS * cfg.layer_bytes / 2**30:.2f} GiB")
    if cfg.tokens != DEFAULT_TOKENS:
        lines.append(f"NOTE: {cfg.tokens} tokens instead of the benchmark's {DEFAULT_TOKENS} (--tokens)")
    lines += [
        f"sequence: {cfg.tokens} tokens = {cfg.pages} pages per (layer, head), {cfg.num_blocks} blocks, "
        f"{cfg.total_bytes / 2**30:.2f} GiB; sparse budget {BUDGET:.2%}; {CLUSTERS} clusters per (layer, head)",
        f"kvstored: engine {server.get('engine', '?')}, O_DIRECT {server.get('direct_io', '?')}, {IO_THREADS} I/O threads; "
        f"{os.cpu_count()} CPUs; median of {cfg.repeats} repeats after one warm-up; dir {cfg.root}",
        f"puts (durable): DRAM store {cfg.total_bytes / info['put_dram_s'] / 1e9:.2f} GB/s, "
        f"SSD stores {2 * cfg.total_bytes / info['put_ssd_s'] / 1e9:.2f} GB/s",
        "",
    ]
    head = ("case", "bytes/op", "GB/s", "baseline", "GB/s", "ratio", "I/Os per get (or rate)", "target", "result")
    table = [head]
    for r in rows:
        table.append((r.case, _size(r.nbytes), f"{r.gb_per_s:.3f}", r.baseline_name, f"{r.baseline:.3f}",
                      f"{r.ratio:.2f}x", r.ios, "-" if r.target is None else f">= {r.target:g}x", r.verdict))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    right = {1, 2, 4, 5}
    for k, row in enumerate(table):
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    for r in rows:
        if r.target is not None:
            lines.append(f"target: {r.case}: {r.gb_per_s:.3f} GB/s / {r.baseline_name} {r.baseline:.3f} GB/s "
                         f"= {r.ratio:.2f}x, target >= {r.target:g}x: {r.verdict}")
        else:
            lines.append(f"info: {r.case}: {r.ios} (get costs {r.extra['us_per_op']:.0f} us, hello "
                         f"{r.extra['baseline_us_per_op']:.0f} us); no target")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a short run: 4 layers, 3 repeats, fewer round trips")
    p.add_argument("--layers", type=int, default=None, help=f"layers stored (default {MODEL_LAYERS}, 4 with --quick)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"sequence length (a multiple of {PAGE_SIZE})")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per case, median reported (default 5, 3 with --quick)")
    p.add_argument("--dir", type=work_dir, default=Path(tempfile.gettempdir()),
                   help="where the daemons' temporary store directories go (needs O_DIRECT; made if missing)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the rows as a JSON list")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, clusters and selections")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = BenchConfig(
            layers=args.layers or (4 if args.quick else MODEL_LAYERS),
            tokens=args.tokens,
            repeats=args.repeats or (3 if args.quick else 5),
            rtt_iters=500 if args.quick else 2000,
            root=args.dir,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"kvdrive-bench store: {exc}", file=sys.stderr)
        return 2
    rows, info = run_store(cfg)
    print(render(rows, cfg, info), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_json() for r in rows], indent=1) + "\n")
    return 0
