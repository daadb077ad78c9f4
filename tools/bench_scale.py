"""``kvdrive-bench scale``: what kvstored keeps per stored block, and how fast it starts,
as a store of small engine blocks grows.

A store of 64 KiB engine blocks on a few TB of SSD holds tens of millions of them, so the
daemon's memory per block and its start-up time per block decide whether it fits the
host and how long a restart keeps the engines waiting. One run starts a private kvstored
and stores ``--blocks`` blocks of ``--block-kib`` KiB, with keys of ``--key-bytes`` bytes
(an engine's prefix hashes), in jobs of ``--job-blocks`` through a :class:`BlockStore`.
At each of ``--steps`` points it prints a row: the daemon's memory per stored block over
the empty daemon's, its own (anonymous: the index, the key table) and the catalog's pages
it maps (file-backed: the page cache's, which the kernel can take back). Then it kills the
daemon as a crash would (SIGKILL), starts it again over the same store and times the
start until it answers (the catalog read and checked, the index and key tables rebuilt),
with the memory after and the start's peak; checks that a sample of the blocks comes back byte for byte; and
runs ``kvstore-inspect`` over the stopped store (its time and peak memory). The summary
gives the restarted daemon's memory against the running one's, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvdrive.tools.bench_soak import Daemon
from kvdrive.tools.cli_paths import output_file, work_dir
from kvdrive.tools.text_table import text_table
from kvdrive_client.integrations.blocks import BlockStore

SAMPLE = 256  # blocks loaded back and checked after the restart


QUICK_BLOCKS = 20_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_BLOCKS:,} blocks, 2 rows")
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks stored in all")
    p.add_argument("--steps", type=int, default=4, help="rows while storing (at equal shares of --blocks)")
    p.add_argument("--block-kib", type=int, default=4, help="block size in KiB")
    p.add_argument("--key-bytes", type=int, default=16, help="bytes of each block's key")
    p.add_argument("--job-blocks", type=int, default=1024, help="blocks a store call")
    p.add_argument("--dram", default="64M", help="the daemon's DRAM tier")
    p.add_argument("--dir", type=work_dir, default=Path(tempfile.gettempdir()),
                   help="where the daemon's temporary directory goes (its SSD tier; made if missing)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the rows as JSON")


def _status(pid: int, field: str) -> int:
    """A size in the process's /proc status (``RssAnon``, ``VmHWM``, ...), in bytes."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(field + ":")).split()[1]) << 10


def _memory(pid: int) -> tuple[int, int]:
    """The process's resident anonymous and file-backed bytes."""
    return _status(pid, "RssAnon"), _status(pid, "RssFile")


def _keys(first: int, n: int, key_bytes: int) -> list[bytes]:
    return [i.to_bytes(8, "little").rjust(key_bytes, b"k") for i in range(first, first + n)]


def _block(i: int, block_bytes: int) -> np.ndarray:
    """Block ``i``'s bytes: its number, then ``i % 251``."""
    row = np.full(block_bytes, i % 251, np.uint8)
    row[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return row


def _row(state: str, blocks: int, seconds: float, mem: tuple[int, int], base: tuple[int, int]) -> dict:
    per = max(blocks, 1)
    return {"state": state, "blocks": blocks, "seconds": round(seconds, 3), "us_per_block": round(seconds / per * 1e6, 2),
            "anon_b_per_block": round((mem[0] - base[0]) / per), "file_b_per_block": round((mem[1] - base[1]) / per)}


def scale(args: argparse.Namespace) -> tuple[list[dict], dict]:
    root = Path(tempfile.mkdtemp(prefix="kvdrive-scale-", dir=args.dir))
    args.sync, args.ssd_max = "durable", str(args.blocks * args.block_kib * 2 * 1024 + (1 << 30))
    args.daemon_args = ["--index-max", str(max(1 << 30, args.blocks * 1024))]
    daemon = Daemon(args, root)
    bb = args.block_kib << 10
    rows, info = [], {}
    try:
        daemon.start()
        base = _memory(daemon.proc.pid)
        store = BlockStore(bb, engine="scale", model="m", address=daemon.address, staging_bytes=64 << 20)
        job = np.zeros((args.job_blocks, bb), np.uint8)
        marks = [args.blocks * (k + 1) // args.steps for k in range(args.steps)]
        done, t0 = 0, time.perf_counter()
        for mark in marks:
            while done < mark:
                n = min(args.job_blocks, mark - done)
                ids = np.arange(done, done + n, dtype="<u8")
                job[:n] = (ids % 251).astype(np.uint8)[:, None]
                job[:n, :8] = ids.view(np.uint8).reshape(n, 8)
                if not all(store.store(_keys(done, n, args.key_bytes), list(job[:n]))):
                    raise RuntimeError(f"a store of blocks {done}..{done + n} failed:\n{daemon.log_tail()}")
                done += n
            rows.append(_row("stored", done, time.perf_counter() - t0, _memory(daemon.proc.pid), base))
        store.close()
        daemon.kill()
        took = daemon.start()
        rows.append(_row("restarted after SIGKILL", done, took, _memory(daemon.proc.pid), base))
        rows[-1]["peak_mib"] = _status(daemon.proc.pid, "VmHWM") >> 20  # the start's peak: nothing else ran in it yet
        info["sample_wrong"] = _check_sample(daemon, args, done)
        daemon.stop()
        rows.append(_inspect(root, done))
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return rows, info


def _check_sample(daemon: Daemon, args: argparse.Namespace, n: int) -> int:
    """Blocks of a sample, across the store, that do not come back with their own bytes."""
    bb = args.block_kib << 10
    ids = np.unique(np.linspace(0, n - 1, min(SAMPLE, n)).astype(np.int64)).tolist()
    store = BlockStore(bb, engine="scale", model="m", address=daemon.address, staging_bytes=16 << 20)
    try:
        out = np.zeros((len(ids), bb), np.uint8)
        got = store.load_rows([_keys(i, 1, args.key_bytes)[0] for i in ids], out, range(len(ids)))
        return sum(not ok or not np.array_equal(out[j], _block(i, bb)) for j, (i, ok) in enumerate(zip(ids, got)))
    finally:
        store.close()


def _inspect(root: Path, blocks: int) -> dict:
    """kvstore-inspect over the stopped store: its time, and its peak memory per block."""
    with open(root / "inspect.json", "wb") as out, open(root / "inspect.err", "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvdrive.tools.inspect", str(root / "ssd"), "--json"],
                                stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # its own peak memory, not the daemon's (another child)
        took = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"kvstore-inspect failed: {(root / 'inspect.err').read_text(errors='replace')}")
    if json.loads((root / "inspect.json").read_text())["engine_blocks"]["blocks"] != blocks:
        raise RuntimeError("kvstore-inspect counted other blocks than were stored")
    return {"state": "kvstore-inspect", "blocks": blocks, "seconds": round(took, 3),
            "us_per_block": round(took / blocks * 1e6, 2), "anon_b_per_block": None, "file_b_per_block": None,
            "peak_mib": round(usage.ru_maxrss / 1024)}


def render(rows: list[dict], args: argparse.Namespace, info: dict) -> str:
    head = ("state", "blocks", "s", "us/block", "own B/block", "mapped B/block")
    body = [(r["state"], f"{r['blocks']:,}", f"{r['seconds']:.2f}", f"{r['us_per_block']:.1f}",
             "-" if r["anon_b_per_block"] is None else str(r["anon_b_per_block"]),
             "-" if r["file_b_per_block"] is None else str(r["file_b_per_block"])) for r in rows]
    lines = [f"kvdrive-bench scale: {args.blocks:,} blocks of {args.block_kib} KiB, {args.key_bytes}-byte keys, "
             f"jobs of {args.job_blocks}; memory per block over the empty daemon's: its own (anonymous) and the "
             f"catalog pages it maps", *text_table(head, body, right={1, 2, 3, 4, 5})]
    running, restarted = rows[-3], rows[-2]
    if running["anon_b_per_block"]:
        lines.append(f"own memory after the restart / running: {restarted['anon_b_per_block'] / running['anon_b_per_block']:.2f}x;"
                     f" start-up {restarted['us_per_block']:.1f} us a block, its peak memory {restarted['peak_mib']} MiB;"
                     f" blocks of a {SAMPLE}-block sample that came back wrong or missing: {info['sample_wrong']};"
                     f" kvstore-inspect's peak memory "
                     f"{rows[-1]['peak_mib']} MiB")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.blocks, args.steps = QUICK_BLOCKS, 2
    if args.blocks < 1 or args.steps < 1 or args.block_kib < 1 or args.job_blocks < 1 or not 8 <= args.key_bytes <= 1024:
        print("kvdrive-bench scale: --blocks, --steps, --block-kib and --job-blocks must be at least 1, "
              "--key-bytes from 8 to 1024", file=sys.stderr)
        return 2
    rows, info = scale(args)
    print(render(rows, args, info), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
    return 1 if info["sample_wrong"] else 0
