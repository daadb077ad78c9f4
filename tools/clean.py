"""kvstore-clean: list, and with ``--delete`` delete, stored sequences a user no longer needs.

A ``generate()`` that was interrupted (a killed process, an exception) leaves its
session's sequences in the store: namespace ``kvdrive``, each named by a random id and
its row, about 90 MiB each for a 4K-token SmolLM2 prompt. This tool finds them, and any
other sequences, by namespace and name pattern and by age, and deletes them.

Two ways in, with the daemon's owner rule in both (a user deletes only its own sequences):

- **A running daemon** (``--address``, or with no DIR the daemon ``kvdrive_client.connect()``
  reaches): it lists the caller's sequences and deletes them through the daemon, which
  checks the owner itself.
- **A stopped store** (``DIR``, the daemon's ``--ssd`` directory): it opens the store as
  kvstored does (refused while a kvstored serves it) and deletes in one catalog commit.
  It takes the caller's own sequences; root may name another owner with ``--uid`` (or
  ``--uid all``).

Without ``--delete`` nothing is deleted: it prints what would go. Exit status: 0 success,
2 usage or store errors.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
import time
from pathlib import Path

from kvdrive.protocol.release import add_version_option

PROG = "kvstore-clean"
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class CleanError(Exception):
    """A refusal, said in one line."""


def parse_age(text: str) -> float:
    m = _AGE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age such as 90s, 30m, 12h or 7d")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="List the stored sequences that match (namespace, name, age) and, with --delete, delete them: "
        "through a running kvstored (--address), or in a stopped store's directory. A user deletes only its "
        "own sequences.",
        epilog="Exit status: 0 success; 2 usage or store errors (a daemon that cannot be reached, a store a "
        "kvstored serves, another user's sequences asked for).",
    )
    add_version_option(p)
    p.add_argument("dir", nargs="?", type=Path, metavar="DIR",
                   help="a stopped store's directory (kvstored --ssd DIR); without it, the running daemon")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="a running kvstored, ipc://PATH or tcp://HOST:PORT (default: the daemon "
                        "kvdrive_client.connect() reaches)")
    p.add_argument("--ns", default="kvdrive", metavar="PATTERN",
                   help="namespaces to match, an fnmatch pattern ('*' for all) (default: kvdrive, generate()'s)")
    p.add_argument("--name", default="*", metavar="PATTERN", help="sequence names to match (default: *)")
    p.add_argument("--older-than", type=parse_age, default=0.0, metavar="AGE",
                   help="only sequences created at least AGE ago: 90s, 30m, 12h, 7d (default: 0, any age)")
    p.add_argument("--uid", default=None, metavar="UID",
                   help="in a stopped store, root only: the owner whose sequences to take, or 'all' "
                        "(default: the caller's own uid)")
    p.add_argument("--delete", action="store_true", help="delete what matches (default: only list it)")
    return p


def _matches(seqs: list[dict], args: argparse.Namespace) -> list[dict]:
    now = time.time()
    return [s for s in seqs if fnmatch.fnmatchcase(s["ns"], args.ns) and fnmatch.fnmatchcase(s["seq"], args.name)
            and now - s["created"] >= args.older_than]


def _report(found: list[dict], deleted: bool) -> None:
    from kvstored.config import format_size  # noqa: PLC0415 - keep --help fast

    now = time.time()
    for s in found:
        print(f"{s['ns']}/{s['seq']}  {format_size(s['bytes'])}  created {_ago(now - s['created'])} ago"
              + (f"  owner {s['owner']}" if "owner" in s else ""))
    total = sum(s["bytes"] for s in found)
    verb = "deleted" if deleted else "would delete (run again with --delete)"
    print(f"{PROG}: {verb} {len(found)} sequences, {format_size(total)}")


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def clean_live(args: argparse.Namespace) -> int:
    from kvdrive_client import StoreError, connect  # noqa: PLC0415

    if args.uid is not None:
        raise CleanError("--uid is for a stopped store: a running daemon deletes only the caller's own sequences")
    try:
        client = connect(args.address)
    except (StoreError, ValueError) as exc:
        raise CleanError(str(exc)) from None
    try:
        found = _matches(client.list(), args)
        if args.delete:
            for s in found:
                client.delete(s["ns"], s["seq"])
    except StoreError as exc:
        raise CleanError(str(exc)) from None
    finally:
        client.close()
    _report(found, args.delete)
    return 0


def _owners(arg: str | None) -> set[int] | None:
    """The owners to take in a stopped store (None: every owner)."""
    me = os.geteuid()
    if arg is None:
        return {me}
    if me != 0:
        raise CleanError(f"--uid is for root: uid {me} may delete only its own sequences")
    if arg == "all":
        return None
    if not arg.isdigit():
        raise CleanError(f"--uid {arg!r} is not a uid number or 'all'")
    return {int(arg)}


def clean_stopped(args: argparse.Namespace) -> int:
    from kvstored.config import DaemonConfig  # noqa: PLC0415 - keep --help fast
    from kvstored.files import StoreOpenError  # noqa: PLC0415
    from kvstored.store import Store  # noqa: PLC0415

    owners = _owners(args.uid)
    if not (args.dir / "meta").is_dir():
        raise CleanError(f"{args.dir} is not a KVDrive store (no meta/ catalog)")
    try:
        store = Store(DaemonConfig(ssd_dir=args.dir, dram_bytes=0, ssd_max_bytes=1 << 60, direct_io=False))
    except StoreOpenError as exc:
        raise CleanError(f"{exc} (a running daemon's sequences are deleted through it: use --address)") from None
    try:
        entries = {e.uid: e for e in store.index.all() if owners is None or e.owner in owners}
        found = _matches([{"uid": e.uid, "ns": e.ns, "seq": e.name, "created": e.created, "bytes": e.bytes,
                           "owner": e.owner} for e in entries.values()], args)
        if args.delete and found:
            store.sequences.delete_entries([entries[s["uid"]] for s in found], "clean")
    finally:
        store.close()
    _report(found, args.delete)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dir is not None and args.address is not None:
        print(f"{PROG}: give DIR (a stopped store) or --address (a running daemon), not both", file=sys.stderr)
        return 2
    try:
        return clean_stopped(args) if args.dir is not None else clean_live(args)
    except CleanError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
