"""``kvdrive-bench flood``: what a well-behaved tenant keeps while another floods kvstored.

One run prints one table. A private kvstored (a temporary directory under ``--dir``,
ipc:// sockets only) serves two tenants:

- the victim, in this process: a durable put of one fresh page (16 KiB: one layer, two
  KV heads, 8 KiB blocks) into its own sequence, one at a time, for ``--seconds``; a
  window reports its put-ack latency (p50, p99) and count;
- the flood, in a process of its own (:mod:`kvdrive.tools.bench_flood_load`):
  ``connections`` (idle ZeroMQ connections that never open a session, plus idle
  session-socket connections), then ``list``, ``puts4m`` and ``ssd-gets`` (sparse gets
  of a sequence eight times the DRAM tier) from one and from eight connections each.

Each flood is a phase of two victim windows: at rest, then, once the flooding process
is set up and flooding, under the flood; the ratios divide the second by the first.
So a shared machine's slow spells (another tenant's fsyncs on the same disk) move
both alike, and the at-rest column shows how much they moved over the run. After
each flood the daemon must answer a hello within :data:`ALIVE_TIMEOUT_S`; one that
died (or hangs) is recorded so and restarted for the next phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from kvdrive.tools.bench_flood_load import (
    GEOMETRY as FLOOD_GEOMETRY, GET_BLOCKS, LIST_SEQUENCES, FloodKind, FloodSpec, flooding,
)
from kvdrive.tools.cli_paths import output_file, work_dir
from kvdrive.tools.text_table import text_table
from kvdrive_client import Geometry, StoreClient, StoreError, StoreUnavailableError
from kvdrive_client.embedded import EmbeddedDaemon

DEFAULT_SECONDS, QUICK_SECONDS = 5.0, 1.0
DEFAULT_CONNECTIONS, QUICK_CONNECTIONS = 512, 128
# Below --max-session-connections-per-uid (128 by default): the flood runs as the victim's uid.
DEFAULT_SESSION_CONNECTIONS, QUICK_SESSION_CONNECTIONS = 96, 32
DEFAULT_DRAM, QUICK_DRAM = 64 << 20, 16 << 20
SSD_DATA_FACTOR = 8  # the ssd-gets flood's sequence, in DRAM tiers
SSD_MAX = 16 << 30
WIDTHS = (1, 8)  # flooding connections of each request flood
VICTIM_GEOMETRY = Geometry(1, 2, 128, "float16", 16)  # a page: 2 blocks of 8 KiB
VICTIM_TIMEOUT_S = 10.0
WARMUP_PUTS = 20
ALIVE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FloodConfig:
    seconds: float
    connections: int
    session_connections: int
    dram_bytes: int
    root: Path
    floods: tuple[FloodKind, ...] = tuple(FloodKind)
    daemon_nofile: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= 60:
            raise ValueError(f"--seconds must be in (0, 60], got {self.seconds}")
        if not 1 <= self.connections <= 4096:
            raise ValueError(f"--connections must be in 1..4096, got {self.connections}")
        if not 0 <= self.session_connections <= 1024:
            raise ValueError(f"--session-connections must be in 0..1024, got {self.session_connections}")
        if self.dram_bytes < 1 << 20:
            raise ValueError(f"--dram-mib must be at least 1, got {self.dram_bytes / 2**20:g}")
        if self.daemon_nofile is not None and self.daemon_nofile < 64:
            raise ValueError(f"--daemon-nofile must be at least 64, got {self.daemon_nofile}")
        if not self.root.is_dir():
            raise ValueError(f"--dir {self.root} is not a directory")

    @property
    def ssd_data_bytes(self) -> int:
        return SSD_DATA_FACTOR * self.dram_bytes


@dataclass(frozen=True)
class Phase:
    kind: FloodKind
    connections: int

    @property
    def label(self) -> str:
        return self.kind.value


def phases(cfg: FloodConfig) -> list[Phase]:
    out = []
    for kind in cfg.floods:
        widths = (cfg.connections,) if kind is FloodKind.CONNECTIONS else WIDTHS
        out += [Phase(kind, w) for w in widths]
    return out


@dataclass
class Window:
    """The victim's puts over one window: latencies (ms) of the acknowledged ones, errors by type."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return len(self.latencies_ms)

    def percentile(self, q: float) -> float | None:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else None

    def to_json(self) -> dict:
        return {"p50_ms": self.percentile(50), "p99_ms": self.percentile(99), "puts": self.count,
                "errors": dict(self.errors)}


@dataclass
class Row:
    phase: Phase
    rest: Window
    flooded: Window
    daemon: str  # after the flood: "alive", "died", "no answer"
    flood: dict = field(default_factory=dict)  # what the flooding process reported

    def ratio(self, q: float) -> float | None:
        return _ratio(self.flooded.percentile(q), self.rest.percentile(q))

    def to_json(self) -> dict:
        return {"flood": self.phase.label, "connections": self.phase.connections, "at_rest": self.rest.to_json(),
                "flooded": self.flooded.to_json(), "p50_vs_rest": self.ratio(50), "p99_vs_rest": self.ratio(99),
                "daemon": self.daemon, "flood_result": self.flood}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# ---------------------------------------------------------------- the daemon and the victim


class Host:
    """The daemon under test and the victim's client, sequence and buffer; :meth:`restart` after a death."""

    def __init__(self, cfg: FloodConfig) -> None:
        self.cfg = cfg
        self.daemon: EmbeddedDaemon | None = None
        self.client: StoreClient | None = None
        self.restarts = 0
        self.info: dict = {}

    def start(self) -> None:
        self.daemon = EmbeddedDaemon(dram=str(self.cfg.dram_bytes), ssd_max=str(SSD_MAX), root=self.cfg.root,
                                     extra_args=["--log-level", "WARNING"])
        self.client = StoreClient(self.daemon.address, timeout=VICTIM_TIMEOUT_S)
        self.daemon.wait_ready(lambda: self.client.ping(timeout=0.5))
        pid = self.daemon.proc.pid
        if self.cfg.daemon_nofile is not None:
            hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (min(self.cfg.daemon_nofile, hard), hard))
        self.info = {"direct_io": self.client.server_info.get("direct_io"),
                     "nofile": resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]}
        self.buf = self.client.register(VICTIM_GEOMETRY.num_kv_heads * VICTIM_GEOMETRY.block_bytes)
        self.buf.array[:] = np.random.default_rng(self.cfg.seed).integers(0, 256, self.buf.size, np.uint8)
        self.seq = self.client.create("victim", f"pages-{self.restarts}", VICTIM_GEOMETRY)
        self.page = 0
        for _ in range(WARMUP_PUTS):
            self.put_page()

    @property
    def address(self) -> str:
        assert self.daemon is not None
        return self.daemon.address

    def put_page(self) -> None:
        """One durable put of the next fresh page; returns once acknowledged."""
        page, self.page = self.page, self.page + 1
        self.client.put_from(self.seq, [0], [page], self.buf)

    def running(self) -> bool:
        return self.daemon.proc.poll() is None

    def status(self) -> str:
        if self.daemon.proc.poll() is not None:
            return "died"
        with StoreClient(self.address, timeout=ALIVE_TIMEOUT_S) as probe:
            return "alive" if probe.ping(timeout=ALIVE_TIMEOUT_S) else "no answer"

    def restart(self) -> None:
        _note(f"  kvstored {'exited' if self.daemon.proc.poll() is not None else 'did not answer'}; log tail:\n"
              f"{self.daemon.log_tail(5)}\n  restarting it for the next phase")
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


@contextlib.contextmanager
def running_host(cfg: FloodConfig) -> Iterator[Host]:
    host = Host(cfg)
    try:
        host.start()
        yield host
    finally:
        host.stop()


def measure_victim(host: Host, seconds: float) -> Window:
    """The victim's puts for ``seconds``, one at a time."""
    window = Window()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        try:
            host.put_page()
        except StoreUnavailableError as exc:  # the daemon is gone: nothing more to measure
            window.errors[type(exc).__name__] += 1
            break
        except StoreError as exc:
            window.errors[type(exc).__name__] += 1
            continue
        window.latencies_ms.append((time.perf_counter() - t0) * 1e3)
    return window


# ---------------------------------------------------------------- the run


def run_phase(host: Host, cfg: FloodConfig, phase: Phase, workdir: Path) -> Row:
    """The victim at rest, then under ``phase``'s flood."""
    rest = measure_victim(host, cfg.seconds)
    spec = FloodSpec(phase.kind, host.address, phase.connections,
                     session_connections=cfg.session_connections if phase.kind is FloodKind.CONNECTIONS else 0,
                     ssd_data_bytes=cfg.ssd_data_bytes, max_seconds=cfg.seconds + 60.0, seed=cfg.seed)
    with flooding(spec, workdir / f"flood-{phase.label}-{phase.connections}.log") as flood:
        flood.wait_ready(host.running)
        flooded = measure_victim(host, cfg.seconds)
        result = flood.finish()
    return Row(phase, rest, flooded, host.status(), result)


def run_flood(cfg: FloodConfig) -> tuple[list[Row], dict]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvdrive-flood-", dir=cfg.root) as tmp, running_host(cfg) as host:
        info = dict(host.info)
        for phase in phases(cfg):
            _note(f"phase: {phase.label} x {phase.connections}: {cfg.seconds:g} s at rest, {cfg.seconds:g} s flooded")
            rows.append(run_phase(host, cfg, phase, Path(tmp)))
            if rows[-1].daemon != "alive":
                host.restart()
        info["restarts"] = host.restarts
    return rows, info


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the table


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _flood_cells(row: Row) -> tuple[str, str, str]:
    """Requests served, their rate, errors."""
    f = row.flood
    seconds = f.get("counts", {}).get("flood_ms", 0) / 1e3
    rate = "-" if row.phase.kind is FloodKind.CONNECTIONS or not seconds else f"{f['ok'] / seconds:,.0f}"
    return f"{f['ok']:,}", rate, f"{sum(f['errors'].values()):,}"


def table_lines(rows: list[Row]) -> list[str]:
    head = ("flood", "conns", "at rest p50 ms", "p99 ms", "flooded p50 ms", "p99 ms", "puts", "errors",
            "p50 vs rest", "p99 vs rest", "flood served", "flood req/s", "flood errors", "daemon")
    body = []
    for row in rows:
        rest, flooded = row.rest, row.flooded
        body.append((row.phase.label, str(row.phase.connections), _ms(rest.percentile(50)), _ms(rest.percentile(99)),
                     _ms(flooded.percentile(50)), _ms(flooded.percentile(99)), str(flooded.count),
                     str(sum(flooded.errors.values())), _times(row.ratio(50)), _times(row.ratio(99)),
                     *_flood_cells(row), "alive" if row.daemon == "alive" else f"daemon {row.daemon}"))
    return text_table(head, body, right=set(range(1, 13)))


def flood_notes(rows: list[Row]) -> list[str]:
    """What each flood did besides its count of requests."""
    lines = []
    for row in rows:
        kind, c = row.phase.kind, row.flood.get("counts", {})
        label = f"{row.phase.label} x {row.phase.connections}"
        if kind is FloodKind.CONNECTIONS:
            lines.append(f"{row.phase.label}: {c.get('zmq_connections', 0)} ZeroMQ connections without a session "
                         f"(hellos answered: {c.get('hellos_first', 0)} on connecting, {c.get('hellos_last', 0)} at "
                         f"the end), {c.get('session_connections', 0)} idle session-socket connections")
        elif kind is FloodKind.PUTS4M and c.get("flood_ms"):
            lines.append(f"{label}: {c.get('bytes', 0) / (c['flood_ms'] / 1e3) / 1e6:,.0f} MB/s of durable 4 MiB puts")
        elif kind is FloodKind.SSD_GETS and c.get("blocks"):
            lines.append(f"{label}: {c['ssd_blocks'] / c['blocks']:.0%} of the flood's blocks read from the SSD tier")
        elif kind is FloodKind.LIST and row.flood.get("ok"):
            lines.append(f"{label}: {c.get('sequences_listed', 0) / row.flood['ok']:.0f} sequences a list")
        errors = row.flood.get("errors") or {}
        if errors:
            lines.append(f"{label}: flood errors " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))
    return lines


def render(rows: list[Row], cfg: FloodConfig, info: dict) -> str:
    vg = VICTIM_GEOMETRY
    put_kib = vg.num_kv_heads * vg.block_bytes // 1024
    lines = [
        f"kvdrive-bench flood: victim: durable put of one fresh {put_kib} KiB page ({vg.num_kv_heads} blocks of "
        f"{vg.block_bytes // 1024} KiB), one at a time, in windows of {cfg.seconds:g} s",
        f"kvstored: DRAM tier {cfg.dram_bytes >> 20} MiB, O_DIRECT {info.get('direct_io', '?')}, descriptor limit "
        f"{info.get('nofile', '?')}; {os.cpu_count()} CPUs; dir {cfg.root}",
        "floods: one process of their own; per flooding connection one thread, one ZeroMQ connection and one "
        "session, each sending its next request when the last is answered; the flooding uid is the victim's "
        "(one machine, one user)",
        f"flood blocks {FLOOD_GEOMETRY.block_bytes // 1024} KiB; list: every sequence of the uid ({LIST_SEQUENCES} "
        f"of the flood's besides); ssd-gets: sparse gets of {GET_BLOCKS} random blocks of a "
        f"{cfg.ssd_data_bytes >> 20} MiB sequence ({SSD_DATA_FACTOR} x the DRAM tier), put before its phase",
        "",
        *table_lines(rows),
        f"at rest: the victim alone for {cfg.seconds:g} s right before the flood starts; puts, errors: the victim's "
        f"under the flood; vs rest: flooded / at rest",
        "",
        *flood_notes(rows),
    ]
    if info.get("restarts"):
        lines.append(f"kvstored died or hung under {info['restarts']} flood(s) and was restarted for the next phase")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_SECONDS:g} s a phase, {QUICK_CONNECTIONS} connections, a {QUICK_DRAM >> 20} MiB DRAM tier")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"victim seconds a phase (default {DEFAULT_SECONDS:g}, {QUICK_SECONDS:g} with --quick)")
    p.add_argument("--connections", type=int, default=None,
                   help=f"ZeroMQ connections of the connections flood (default {DEFAULT_CONNECTIONS}, "
                        f"{QUICK_CONNECTIONS} with --quick)")
    p.add_argument("--session-connections", type=int, default=None,
                   help=f"idle session-socket connections of the connections flood (default "
                        f"{DEFAULT_SESSION_CONNECTIONS}, {QUICK_SESSION_CONNECTIONS} with --quick)")
    p.add_argument("--dram-mib", type=int, default=None,
                   help=f"the daemon's DRAM tier in MiB (default {DEFAULT_DRAM >> 20}, {QUICK_DRAM >> 20} with --quick); "
                        f"the ssd-gets data is {SSD_DATA_FACTOR} times it")
    p.add_argument("--floods", type=lambda s: s.split(","), default=[k.value for k in FloodKind],
                   help="comma-separated, of " + ", ".join(k.value for k in FloodKind) + " (default all)")
    p.add_argument("--daemon-nofile", type=int, default=None,
                   help="lower the daemon's descriptor limit to this (default: the one it inherits)")
    p.add_argument("--dir", type=work_dir, default=Path(tempfile.gettempdir()),
                   help="where the daemon's temporary directory goes; made if missing")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the bytes put and the blocks got")


def config_from(args: argparse.Namespace) -> FloodConfig:
    def pick(value, default, quick):
        return value if value is not None else (quick if args.quick else default)

    try:
        floods = tuple(FloodKind(f) for f in args.floods)
    except ValueError:
        raise ValueError(f"--floods takes {', '.join(k.value for k in FloodKind)}; got {','.join(args.floods)}") from None
    return FloodConfig(
        seconds=pick(args.seconds, DEFAULT_SECONDS, QUICK_SECONDS),
        connections=pick(args.connections, DEFAULT_CONNECTIONS, QUICK_CONNECTIONS),
        session_connections=pick(args.session_connections, DEFAULT_SESSION_CONNECTIONS, QUICK_SESSION_CONNECTIONS),
        dram_bytes=pick(None if args.dram_mib is None else args.dram_mib << 20, DEFAULT_DRAM, QUICK_DRAM),
        root=args.dir, floods=floods, daemon_nofile=args.daemon_nofile, seed=args.seed,
    )


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does: through every ``finally``, so the daemon and the flood stop."""
    def exit_(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from(args)
    except ValueError as exc:
        print(f"kvdrive-bench flood: {exc}", file=sys.stderr)
        return 2
    with terminate_as_exit():
        rows, info = run_flood(cfg)
    print(render(rows, cfg, info), flush=True)
    if args.json is not None:
        doc = {"config": {"seconds": cfg.seconds, "connections": cfg.connections,
                          "session_connections": cfg.session_connections, "dram_bytes": cfg.dram_bytes,
                          "ssd_data_bytes": cfg.ssd_data_bytes, "daemon_nofile": cfg.daemon_nofile},
               "info": info, "rows": [r.to_json() for r in rows]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
