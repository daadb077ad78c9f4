"""``kvdrive-bench soak``: kvstored over a long run of engine traffic, interval by interval.

A cache's steady state is not its first minute: the store has filled past its DRAM tier
and its quota, every store evicts older blocks, loads and stores run at once, and
whatever the daemon keeps per block, per request or per session has had time to grow.
One run starts a private kvstored (DRAM tier ``--dram``, its namespaces held to
``--quota``) and an engine-like client: a :class:`BlockStore` over a host pool in shared
memory, moved in place as vLLM's and SGLang's adapters move theirs, with

- a store thread writing jobs of ``--job-blocks`` fresh blocks at ``--store-gbps``;
- a load thread loading, ``--loads`` times a second, one earlier job whole (as an
  engine loads a prefix): half the time one of the last few stored, else any job ever
  stored, so some have been evicted (a load hits while the job's blocks are all stored).

Every block carries its key in its first bytes and the rest of a pattern of its own
row; every loaded block is checked, so a wrong byte in hours of traffic is counted.

Every ``--interval`` seconds one row: store and load latency per job (p50, p99, the
slowest: a stall of the daemon's shows there when a p99 of few jobs misses it), what
moved, the load hit rate, and the daemon's resident memory, memory mappings,
descriptors, threads, catalog and data file sizes (as allocated on disk). At the end,
the last interval against the first one after the stores filled the quota: the latency
ratios and what the daemon's footprint grew by (and per hour, at that pace).

``--kill-every S`` kills the daemon as a crash would (SIGKILL) every S seconds while the
traffic runs, and starts it again over the same store: the client's calls fail while it
is down (stores not stored, loads missed) and go on once it is back, with no set-up of
the caller's. After each restart the last job a store had acknowledged before the kill
is loaded and checked: an acknowledged block is never lost. The summary adds the kills,
how long each start took to answer, and the blocks lost.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvdrive.layout.format import DATA_FILE
from kvdrive.tools.bench_tier_stress import nearest_rank_ms
from kvdrive.tools.cli_paths import output_file, work_dir
from kvdrive.tools.text_table import text_table
from kvdrive_client.integrations.blocks import BlockStore
from kvdrive_client.store import StoreClient
from kvstored.config import format_size, parse_size

KEY_BYTES = 8  # a block's first bytes: its key's number, little-endian
RECENT_JOBS = 4  # "recent": one of the last this many jobs stored


@dataclass
class Interval:
    seconds: float  # since the run began, at the interval's end
    stored_bytes: int  # stored (acknowledged) since the run began, at its end
    store_gbps: float
    store_p50_ms: float | None
    store_p99_ms: float | None
    store_max_ms: float | None  # the interval's slowest: a stall a p99 of few samples can miss
    loads: int
    load_p50_ms: float | None
    load_p99_ms: float | None
    load_max_ms: float | None
    hit_rate: float | None  # blocks found / blocks asked
    wrong_blocks: int  # loaded blocks whose bytes were not the stored ones
    failed_stores: int  # blocks a store call answered not stored
    rss_mib: float
    maps: int
    fds: int
    threads: int
    catalog_mib: float
    data_mib: float  # the data file's allocated bytes
    evicted: int  # blocks the quota evicted, since the run began
    kills: int  # the daemon was killed and started again this many times, so far


@dataclass
class Samples:
    """What the two threads measured since the last interval ended (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    store_s: list[float] = field(default_factory=list)
    stored_blocks: int = 0
    failed_stores: int = 0
    load_s: list[float] = field(default_factory=list)
    asked: int = 0
    found: int = 0
    wrong: int = 0

    def take(self) -> Samples:
        with self.lock:
            out = Samples(store_s=self.store_s, stored_blocks=self.stored_blocks, failed_stores=self.failed_stores,
                          load_s=self.load_s, asked=self.asked, found=self.found, wrong=self.wrong)
            self.store_s, self.load_s = [], []
            self.stored_blocks = self.failed_stores = self.asked = self.found = self.wrong = 0
        return out


def _p(samples: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of ``samples`` (seconds) in ms; None for none."""
    return nearest_rank_ms(samples, q) if samples else None


def _key(n: int) -> bytes:
    return b"soak" + n.to_bytes(KEY_BYTES, "little")


class Traffic:
    """The engine-like client: its host pool, its block store, the store and load threads."""

    def __init__(self, args: argparse.Namespace, address: str) -> None:
        self.args, self.block_bytes, self.job = args, args.block_kib << 10, args.job_blocks
        # Rows [0, job) are the store thread's, [job, 2 job) the load thread's.
        self._fd = os.memfd_create("kvdrive-soak", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, 2 * self.job * self.block_bytes)
        self._map = mmap.mmap(self._fd, 2 * self.job * self.block_bytes)
        self.rows = np.frombuffer(self._map, np.uint8).reshape(2 * self.job, self.block_bytes)
        self.pattern = np.random.default_rng(args.seed).integers(0, 256, (self.job, self.block_bytes), np.uint8)
        self.rows[: self.job] = self.pattern
        self.store = BlockStore(self.block_bytes, engine="soak", model="m", address=address, timeout=30.0)
        self.in_place = self.store.share(self.rows)
        self.samples = Samples()
        self.jobs = 0  # jobs stored; job j's keys are j * job ... (j + 1) * job - 1
        self.acked = -1  # the last job every block of which a store acknowledged
        self.stored_total = 0  # blocks stored, acknowledged
        self._stop = threading.Event()
        self._rng = np.random.default_rng(args.seed + 1)
        self._threads = [threading.Thread(target=self._guard(self._stores), name="soak-stores", daemon=True),
                         threading.Thread(target=self._guard(self._loads), name="soak-loads", daemon=True)]
        self.error: BaseException | None = None

    def _guard(self, loop):
        def run() -> None:
            try:
                loop()
            except BaseException as exc:  # noqa: BLE001 - reported by the interval loop, which stops the run
                self.error = exc
                self._stop.set()
        return run

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.store.close()
        os.close(self._fd)  # the mapping goes with the last view of it

    def _stores(self) -> None:
        job_bytes = self.job * self.block_bytes
        period = job_bytes / (self.args.store_gbps * 1e9)
        due = time.perf_counter()
        while not self._stop.is_set():
            first = self.jobs * self.job
            keys = [_key(first + i) for i in range(self.job)]
            heads = np.arange(first, first + self.job, dtype="<u8").view(np.uint8).reshape(self.job, KEY_BYTES)
            self.rows[: self.job, :KEY_BYTES] = heads
            t0 = time.perf_counter()
            done = self.store.store_rows(keys, self.rows[: self.job], range(self.job))
            took = time.perf_counter() - t0
            with self.samples.lock:
                self.samples.store_s.append(took)
                self.samples.stored_blocks += sum(done)
                self.samples.failed_stores += len(done) - sum(done)
            self.stored_total += sum(done)
            if all(done):
                self.acked = self.jobs
            self.jobs += 1
            due = max(due + period, time.perf_counter() - period)  # a late job does not make the next ones burst
            self._stop.wait(max(0.0, due - time.perf_counter()))

    def _loads(self) -> None:
        period = 1.0 / self.args.loads
        out = self.rows[self.job:]
        while not self._stop.wait(period):
            jobs = self.jobs
            if jobs == 0:
                continue
            recent = self._rng.random() < 0.5
            j = int(self._rng.integers(max(0, jobs - RECENT_JOBS), jobs)) if recent else int(self._rng.integers(0, jobs))
            first = j * self.job
            out[:, :KEY_BYTES] = 0
            t0 = time.perf_counter()
            done = self.store.load_rows([_key(first + i) for i in range(self.job)], out, range(self.job))
            took = time.perf_counter() - t0
            wrong = 0
            for i, ok in enumerate(done):
                if ok and (int.from_bytes(bytes(out[i, :KEY_BYTES]), "little") != first + i
                           or not np.array_equal(out[i, KEY_BYTES:], self.pattern[i, KEY_BYTES:])):
                    wrong += 1
            with self.samples.lock:
                self.samples.load_s.append(took)
                self.samples.asked += len(done)
                self.samples.found += sum(done)
                self.samples.wrong += wrong


def job_keys(j: int, job: int) -> list[bytes]:
    return [_key(j * job + i) for i in range(job)]


def check_job(traffic: Traffic, address: str, j: int) -> int:
    """Load job ``j`` through a store of its own (staging: none of the traffic's state);
    how many of its blocks are missing or wrong."""
    store = BlockStore(traffic.block_bytes, engine="soak", model="m", address=address, timeout=30.0)
    try:
        out = np.zeros((traffic.job, traffic.block_bytes), np.uint8)
        done = store.load(job_keys(j, traffic.job), list(out))
    finally:
        store.close()
    bad = 0
    for i, ok in enumerate(done):
        head = int.from_bytes(bytes(out[i, :KEY_BYTES]), "little")
        bad += not ok or head != j * traffic.job + i or not np.array_equal(out[i, KEY_BYTES:],
                                                                            traffic.pattern[i, KEY_BYTES:])
    return bad


class Daemon:
    """A private kvstored over a store in ``root``, which :meth:`kill` stops as a crash does
    and :meth:`start` starts again over the same store."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.root, self.address = root, f"ipc://{root / 'kvstored.sock'}"
        self.cmd = [sys.executable, "-m", "kvstored", "--ssd", str(root / "ssd"), "--dram", args.dram,
                    "--ssd-max", args.ssd_max, "--listen", self.address, "--parent-pid", str(os.getpid()),
                    "--sync", args.sync, "--log-level", "WARNING"]
        if getattr(args, "quota", None) is not None:
            self.cmd += ["--quota", f"soak/*={args.quota}"]
        self.cmd += getattr(args, "daemon_args", [])
        self._log = open(root / "kvstored.log", "ab")  # noqa: SIM115 - kept for the daemon's whole life
        self.proc: subprocess.Popen | None = None

    def start(self, deadline_s: float = 300.0) -> float:
        """Start it; the seconds until it answered."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        with StoreClient(self.address, timeout=10.0) as probe:
            while not probe.ping(timeout=0.5):
                if self.proc.poll() is not None or time.perf_counter() - t0 > deadline_s:
                    raise RuntimeError(f"kvstored did not start (exit {self.proc.poll()}):\n{self.log_tail()}")
        return time.perf_counter() - t0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def log_tail(self, lines: int = 10) -> str:
        return "\n".join((self.root / "kvstored.log").read_text(errors="replace").splitlines()[-lines:])


def _proc(pid: int) -> tuple[float, int, int, int]:
    """The daemon's resident MiB, memory mappings, open descriptors and threads."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss = int(status["VmRSS"].split()[0]) / 1024
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    return rss, maps, len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"])


def _allocated_mib(paths: list[Path]) -> float:
    return sum(p.stat().st_blocks * 512 for p in paths if p.is_file()) / (1 << 20)


def _interval(traffic: Traffic, daemon: Daemon, run: dict, t0: float, span: float) -> Interval:
    s = traffic.samples.take()
    ssd = daemon.root / "ssd"
    rss, maps, fds, threads = _proc(daemon.proc.pid)
    with StoreClient(daemon.address, timeout=10.0) as client:
        run["evicted_now"] = int(client.stats().get("counters", {}).get("blocks_quota_evicted", 0))
    return Interval(
        seconds=time.perf_counter() - t0, stored_bytes=traffic.stored_total * traffic.block_bytes,
        store_gbps=s.stored_blocks * traffic.block_bytes / span / 1e9,
        store_p50_ms=_p(s.store_s, 0.5), store_p99_ms=_p(s.store_s, 0.99), store_max_ms=_p(s.store_s, 1.0),
        loads=len(s.load_s), load_p50_ms=_p(s.load_s, 0.5), load_p99_ms=_p(s.load_s, 0.99),
        load_max_ms=_p(s.load_s, 1.0),
        hit_rate=s.found / s.asked if s.asked else None, wrong_blocks=s.wrong, failed_stores=s.failed_stores,
        rss_mib=rss, maps=maps, fds=fds, threads=threads,
        catalog_mib=_allocated_mib([p for p in ssd.rglob("*.mdb")]), data_mib=_allocated_mib([ssd / DATA_FILE]),
        evicted=run["evicted_before"] + run["evicted_now"], kills=len(run["restart_s"]),
    )


def _kill_and_restart(daemon: Daemon, traffic: Traffic, run: dict) -> None:
    """SIGKILL, start again, then check the last job acknowledged before the kill."""
    acked = traffic.acked
    with StoreClient(daemon.address, timeout=10.0) as client:  # counters start again with the daemon
        run["evicted_before"] += int(client.stats().get("counters", {}).get("blocks_quota_evicted", 0))
    run["evicted_now"] = 0
    daemon.kill()
    run["restart_s"].append(daemon.start())
    if acked >= 0:
        lost = check_job(traffic, daemon.address, acked)
        run["checked"] += traffic.job
        run["lost"] += lost
    print(f"  killed kvstored; it answered again in {run['restart_s'][-1]:.2f} s; job {acked}, acknowledged before "
          f"the kill: {'every block back' if acked < 0 or not lost else f'{lost} blocks lost or wrong'}",
          file=sys.stderr, flush=True)


def soak(args: argparse.Namespace) -> tuple[list[Interval], dict]:
    root = Path(tempfile.mkdtemp(prefix="kvdrive-soak-", dir=args.dir))
    daemon, traffic = Daemon(args, root), None
    rows: list[Interval] = []
    run = {"restart_s": [], "checked": 0, "lost": 0, "evicted_before": 0, "evicted_now": 0}
    info: dict = {}
    try:
        daemon.start()
        traffic = Traffic(args, daemon.address)
        traffic.store.wait_open(30.0)
        with StoreClient(daemon.address, timeout=10.0) as client:
            info = {"in_place": traffic.in_place, "direct_io": client.hello().get("direct_io")}
        t0 = time.perf_counter()
        end = t0 + args.minutes * 60
        next_kill = t0 + args.kill_every if args.kill_every else float("inf")
        traffic.start()
        last = t0
        try:
            while time.perf_counter() < end and traffic.error is None and daemon.proc.poll() is None:
                time.sleep(max(0.0, min(end, last + args.interval, next_kill) - time.perf_counter()))
                if time.perf_counter() >= next_kill and time.perf_counter() < end:
                    _kill_and_restart(daemon, traffic, run)
                    next_kill = time.perf_counter() + args.kill_every
                    continue
                now = time.perf_counter()
                rows.append(_interval(traffic, daemon, run, t0, now - last))
                last = now
                print(_row_line(rows[-1]), file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # the rows so far are the run's
            info["interrupted"] = True
        info["daemon_exit"] = daemon.proc.poll()
        info["error"] = None if traffic.error is None else repr(traffic.error)
    finally:
        if traffic is not None:
            traffic.stop()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    info.update(kills=len(run["restart_s"]), restart_s=run["restart_s"], checked_after_kills=run["checked"],
                lost_after_kills=run["lost"])
    return rows, info


# ---------------------------------------------------------------- the table


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _cells(r: Interval) -> tuple[str, ...]:
    return (f"{r.seconds:.0f}", format_size(r.stored_bytes), f"{r.store_gbps:.2f}", _ms(r.store_p50_ms),
            _ms(r.store_p99_ms), _ms(r.store_max_ms), str(r.loads), _ms(r.load_p50_ms), _ms(r.load_p99_ms),
            _ms(r.load_max_ms),
            "-" if r.hit_rate is None else f"{r.hit_rate:.2f}", str(r.wrong_blocks), str(r.failed_stores),
            f"{r.rss_mib:.0f}", str(r.maps), str(r.fds), str(r.threads), f"{r.catalog_mib:.1f}", f"{r.data_mib:.0f}",
            str(r.evicted), str(r.kills))


HEAD = ("s", "stored", "store GB/s", "store p50", "p99", "max ms", "loads", "load p50", "p99", "max ms", "hits", "wrong",
        "not stored", "RSS MiB", "maps", "fds", "threads", "catalog MiB", "data MiB", "evicted", "kills")


def _row_line(r: Interval) -> str:
    return "  " + "  ".join(f"{h}={c}" for h, c in zip(HEAD, _cells(r)))


def _steady(rows: list[Interval], quota: int) -> Interval | None:
    """The first interval that began with the quota already filled (every store evicts)."""
    for before, row in zip(rows, rows[1:]):
        if before.stored_bytes >= quota:
            return row
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def summary(rows: list[Interval], args: argparse.Namespace, info: dict) -> list[str]:
    wrong = sum(r.wrong_blocks for r in rows)
    failed = sum(r.failed_stores for r in rows)
    lines = [f"wrong blocks loaded: {wrong}; blocks a store did not store: {failed}; kvstored "
             + ("alive at the end" if info.get("daemon_exit") is None else f"exited with {info['daemon_exit']}")
             + ("" if info.get("error") is None else f"; the traffic stopped on {info['error']}")]
    for op in ("store", "load"):
        worst = [(getattr(r, f"{op}_max_ms"), r.seconds) for r in rows if getattr(r, f"{op}_max_ms") is not None]
        if worst:
            ms, at = max(worst)
            lines.append(f"the slowest {op} of the run: {ms:.1f} ms (in the interval ending at {at:.0f} s)")
    if info.get("kills"):
        starts = info["restart_s"]
        lines.append(f"kvstored killed (SIGKILL) and started again {info['kills']} times: it answered again in "
                     f"{min(starts):.2f} to {max(starts):.2f} s; of the {info['checked_after_kills']} blocks of the "
                     f"jobs acknowledged last before each kill, {info['lost_after_kills']} lost or wrong")
    first, last = _steady(rows, parse_size(args.quota)), rows[-1] if rows else None
    if first is None or last is None or first is last:
        lines.append("the stores never filled the quota with an interval to spare: no steady state to compare "
                     "(a longer run, a smaller --quota or a faster --store-gbps)")
        return lines
    if last.kills != first.kills:
        lines.append(f"kvstored was killed between the first interval after the quota filled (at {first.seconds:.0f} s) "
                     "and the last: their latency and footprint are not compared")
        return lines
    hours = (last.seconds - first.seconds) / 3600
    lines.append(f"steady state, the last interval against the first after the quota filled (at {first.seconds:.0f} s): "
                 f"store p99 {_ratio(last.store_p99_ms, first.store_p99_ms)}, load p99 "
                 f"{_ratio(last.load_p99_ms, first.load_p99_ms)}, store p50 {_ratio(last.store_p50_ms, first.store_p50_ms)}, "
                 f"load p50 {_ratio(last.load_p50_ms, first.load_p50_ms)}")
    grew = last.rss_mib - first.rss_mib
    lines.append(f"kvstored grew meanwhile by {grew:+.1f} MiB resident ({grew / hours:+.0f} MiB an hour at that pace), "
                 f"{last.maps - first.maps:+d} mappings, {last.fds - first.fds:+d} descriptors, "
                 f"{last.threads - first.threads:+d} threads, catalog {last.catalog_mib - first.catalog_mib:+.1f} MiB, "
                 f"data file {last.data_mib - first.data_mib:+.0f} MiB")
    return lines


def render(rows: list[Interval], args: argparse.Namespace, info: dict) -> str:
    head = [f"kvdrive-bench soak: {args.minutes:g} min, {args.job_blocks}-block jobs of {args.block_kib} KiB blocks, "
            f"stores at {args.store_gbps:g} GB/s ({args.sync}), {args.loads:g} loads/s; kvstored DRAM {args.dram}, "
            f"quota {args.quota}, O_DIRECT {info.get('direct_io', '?')}, blocks moved "
            + ("in place" if info.get("in_place") else "through staging")
            + (f"; kvstored killed every {args.kill_every:g} s" if args.kill_every else "")]
    return "\n".join(head + text_table(HEAD, [_cells(r) for r in rows], right=set(range(len(HEAD))))
                     + summary(rows, args, info))


# ---------------------------------------------------------------- command line


# Defaults, and --quick's (a short run over a small quota, for a check that it all works).
DEFAULTS = {"minutes": 10.0, "interval": 30.0, "block_kib": 2048, "job_blocks": 32, "store_gbps": 0.5, "loads": 4.0,
            "dram": "256M", "quota": "2G"}
QUICK = {"minutes": 0.25, "interval": 4.0, "block_kib": 256, "job_blocks": 32, "store_gbps": 0.2, "loads": 4.0,
         "dram": "32M", "quota": "64M"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    def opt(name: str, kind, what: str) -> None:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{what} (default {DEFAULTS[name]}, {QUICK[name]} with --quick)")

    p.add_argument("--quick", action="store_true", help="a short run over a small quota")
    opt("minutes", float, "how long the traffic runs")
    opt("interval", float, "seconds a row")
    opt("block_kib", int, "block size in KiB (an engine block, every layer)")
    opt("job_blocks", int, "blocks a store or load call")
    opt("store_gbps", float, "the stores' pace in GB/s (a job is sent when due)")
    opt("loads", float, "load jobs a second")
    opt("dram", str, "the daemon's DRAM tier")
    opt("quota", str, "what the traffic's namespace may hold; past it, the least recently used go")
    p.add_argument("--kill-every", type=float, default=None, metavar="S",
                   help="kill kvstored (SIGKILL) every S seconds and start it again over its store (default: never)")
    p.add_argument("--ssd-max", default="16G", help="the daemon's SSD tier")
    p.add_argument("--sync", choices=("durable", "write-behind"), default="durable", help="the daemon's --sync")
    p.add_argument("--dir", type=work_dir, default=Path(tempfile.gettempdir()),
                   help="where the daemon's temporary directory goes (its SSD tier: put it on the disk to soak; made if missing)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the blocks' bytes and the loads' picks")


def _check(args: argparse.Namespace) -> None:
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("minutes", "interval", "store_gbps", "loads") + (("kill_every",) if args.kill_every is not None else ()):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be above 0")
    if args.block_kib < 4 or args.block_kib % 4 or not 0 < args.job_blocks <= 1024:
        raise ValueError("--block-kib takes a multiple of 4 KiB; --job-blocks 1 to 1024")
    for name in ("dram", "quota", "ssd_max"):
        parse_size(getattr(args, name))  # ValueError naming the size


def run(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except ValueError as exc:
        print(f"kvdrive-bench soak: {exc}", file=sys.stderr)
        return 2
    rows, info = soak(args)
    print(render(rows, args, info), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"info": info, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    bad = (sum(r.wrong_blocks for r in rows) or info.get("lost_after_kills") or info.get("daemon_exit") is not None
           or info.get("error") is not None)
    return 1 if bad else 0
