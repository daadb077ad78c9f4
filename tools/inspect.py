"""kvstore-inspect: how a KVDrive store lays its blocks out, and whether they are intact.

It reads the directory of ``kvstored --ssd DIR`` itself: the LMDB catalog, opened
read-only as a registered reader (so it is safe next to a running daemon), and the
data file, with plain preads. ``--address`` adds what only a running daemon knows:
the DRAM tier, the SSD cap, which blocks are resident; ``--address`` with no value asks
the daemon ``kvdrive_client.connect()`` reaches (``$KVDRIVE_ADDRESS``, else the user's
runtime-directory socket, else ``/run/kvdrive/kvstored.sock``).

Terms: a *partition* is one (sequence, layer, KV head). Its pages live in
*extents*, one per put, with the pages of one cluster packed side by side. A *run*
is a stretch of consecutive slots of one cluster: the fewer runs (the longer the
mean run), the fewer reads a cluster-sparse get needs. *Page runs* ask the same
question for token-order reads: stretches of consecutive page numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvdrive.layout.allocator import ExtentAllocator
from kvdrive.layout.format import DATA_FILE, FORMAT_VERSION, META_DIR
from kvdrive.layout.geometry import Geometry
from kvdrive.protocol.address import ADDRESS_ENV, SOCKET_NAME, SYSTEM_SOCKET, default_runtime_dir
from kvdrive.protocol.release import add_version_option

if TYPE_CHECKING:
    from kvstored.catalog import Catalog, CatalogDamagedError, CatalogMissingError, ExtentRecord, SeqRecord

# kvstored.catalog and kvstored.config load numba (about half a second): they are imported
# where the store is read, so that --help and usage errors answer at once.

PROG = "kvstore-inspect"
READ_CHUNK = 16 << 20
PROGRESS_INTERVAL_S = 0.25
# Capacity for the free-space complement when the cap is unknown (a stopped store).
UNBOUNDED = 1 << 62


class InspectError(Exception):
    """Something the user can fix: a wrong directory, an unknown sequence, no daemon. Exit status 2."""


def _format_size(n: float) -> str:
    from kvstored.config import format_size  # noqa: PLC0415

    return format_size(n)


# ---------------------------------------------------------------- reading the store


@dataclass
class BlockPart:
    """Part ``layer`` of every block of a block namespace, by offset: block ``i``'s part is
    one page (its slot ``slots[i]``) at ``offsets[i]`` in extent ``ext_ids[i]``."""

    offsets: np.ndarray
    slots: np.ndarray
    crcs: np.ndarray
    ext_ids: np.ndarray

    def record(self, uid: int, layer: int, i: int) -> ExtentRecord:
        from kvstored.block_columns import part_record  # noqa: PLC0415

        return part_record(uid, layer, self.ext_ids[i], self.offsets[i], self.slots[i], self.crcs[i])


@dataclass
class Partition:
    seq: SeqRecord
    layer: int
    head: int
    records: list[ExtentRecord] = field(default_factory=list)
    blocks: BlockPart | None = None  # where it is a block namespace's part, read as columns

    @property
    def extents(self) -> list[ExtentRecord]:
        """Its extents as records, by offset (made here for a block namespace's part)."""
        if self.blocks is None:
            return self.records
        return [self.blocks.record(self.seq.uid, self.layer, i) for i in range(len(self.blocks.offsets))]

    def num_extents(self) -> int:
        return len(self.records) if self.blocks is None else len(self.blocks.offsets)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Each extent's offset and bytes. Damaged extent records are left out: their space counts as free."""
        bb = self.seq.geometry.block_bytes
        if self.blocks is not None:
            return self.blocks.offsets, np.full(len(self.blocks.offsets), bb, np.int64)
        return (np.fromiter((e.offset for e in self.records), np.int64, len(self.records)),
                np.fromiter((len(e.pages) * bb for e in self.records), np.int64, len(self.records)))

    def pages(self) -> np.ndarray:
        if self.blocks is not None:
            return self.blocks.slots
        return np.concatenate([e.pages for e in self.records]) if self.records else np.zeros(0, np.int64)

    def describe(self) -> dict:
        if self.blocks is not None:  # one page an extent, no clusters: a run and a page run each
            n = len(self.blocks.offsets)
            extents, pages, clusters, runs, page_runs = n, n, min(n, 1), n, n
        else:
            extents, pages = len(self.records), sum(len(e.pages) for e in self.records)
            clusters = len(np.unique(np.concatenate([e.cluster for e in self.records]))) if self.records else 0
            runs = sum(_runs(e.cluster) for e in self.records)
            page_runs = sum(_page_runs(e.pages) for e in self.records)
        return {
            **_name(self.seq), "layer": self.layer, "head": self.head, "extents": extents,
            "pages": pages, "bytes": pages * self.seq.geometry.block_bytes, "clusters": clusters,
            "runs": runs, "mean_run": _ratio(pages, runs), "page_runs": page_runs,
        }


@dataclass
class Layout:
    """One consistent snapshot of a store directory's catalog, plus its data file."""

    ssd_dir: Path
    catalog: Catalog
    sequences: list[SeqRecord]
    partitions: dict[tuple[int, int, int], Partition]
    problems: list[str]  # the catalog's damage, in words (its damaged records are left out)
    file_bytes: int
    num_blocks: int = 0  # engine blocks (kvstored/blocks.py), in the sequences of BLOCKS_NAME

    @property
    def data_path(self) -> Path:
        return self.ssd_dir / DATA_FILE

    def used_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Every extent's offset and bytes, by offset then bytes."""
        spans = [p.spans() for p in self.partitions.values()]
        starts = np.concatenate([a for a, _ in spans]) if spans else np.zeros(0, np.int64)
        nbytes = np.concatenate([b for _, b in spans]) if spans else np.zeros(0, np.int64)
        order = np.lexsort((nbytes, starts))
        return starts[order], nbytes[order]


def open_layout(ssd_dir: Path, columns: bool = True) -> Layout:
    """The store's catalog, checked; with ``columns``, a sound catalog's block namespaces as
    columns (a store of small blocks holds millions: a record each would not fit in memory)."""
    import lmdb  # noqa: PLC0415

    from kvstored.catalog import Catalog, CatalogDamagedError, CatalogMissingError, StoreOpenError  # noqa: PLC0415
    from kvstored.config import DaemonConfig  # noqa: PLC0415

    if not ssd_dir.exists():
        raise InspectError(f"{ssd_dir}: no such directory")
    if not ssd_dir.is_dir():
        raise InspectError(f"{ssd_dir} is not a directory (give the daemon's --ssd directory)")
    if not (ssd_dir / DATA_FILE).is_file():  # a missing catalog beside the data file is the catalog's to explain
        raise InspectError(f"{ssd_dir} is not a KVDrive store (no {META_DIR}/ catalog and {DATA_FILE} data file)")
    file_bytes = os.stat(ssd_dir / DATA_FILE).st_size
    # The daemon's own checks, before LMDB maps the file (a damaged one raises CatalogDamagedError).
    try:
        catalog = Catalog(ssd_dir / META_DIR, DaemonConfig.lmdb_map_bytes, durable=False, readonly=True, data_bytes=file_bytes)
    except (CatalogDamagedError, CatalogMissingError):
        raise
    except StoreOpenError as exc:
        raise InspectError(str(exc)) from None
    try:
        # One read transaction: a daemon writing meanwhile cannot show us extents without
        # their sequence or a sequence without its extents.
        contents = catalog.read(file_bytes, columns=columns)
    except lmdb.Error as exc:
        catalog.close()
        raise CatalogDamagedError(ssd_dir / META_DIR, [f"reading it failed: {exc}"]) from None
    by_uid = {s.uid: s for s in contents.sequences}
    partitions: dict[tuple[int, int, int], Partition] = {}
    for ext in contents.extents:
        key = (ext.uid, ext.layer, ext.head)
        partitions.setdefault(key, Partition(by_uid[ext.uid], ext.layer, ext.head)).records.append(ext)
    for part in partitions.values():
        part.records.sort(key=lambda e: e.offset)
    for uid, cols in contents.block_columns.items():
        for layer in range(cols.ext_ids.shape[1]):
            o = np.argsort(cols.offsets[:, layer], kind="stable")
            partitions[(uid, layer, 0)] = Partition(by_uid[uid], layer, 0, blocks=BlockPart(
                cols.offsets[o, layer], cols.slots[o], cols.crcs[o, layer], cols.ext_ids[o, layer]))
    num_blocks = len(contents.blocks) + sum(len(c.keys) for c in contents.block_columns.values())
    return Layout(ssd_dir, catalog, contents.sequences, partitions, contents.problems, file_bytes, num_blocks)


@dataclass
class Live:
    address: str
    stats: dict
    sequences: list[dict]


def query_daemon(address: str, timeout: float) -> Live:
    """The live figures of the daemon at ``address`` ('' for the default daemon, as ``connect()``)."""
    from kvdrive_client import StoreError, connect  # noqa: PLC0415 - only live mode needs ZeroMQ
    from kvdrive_client.locate import DEFAULT  # noqa: PLC0415

    if address and not (address.startswith("ipc://") or address.startswith("tcp://")):
        hint = (f"; to inspect the directory {address} with the default daemon, put it before --address"
                if Path(address).is_dir() else "")
        raise InspectError(f"--address {address!r}: use ipc://PATH or tcp://HOST:PORT{hint}")
    try:
        client = connect(address or DEFAULT, timeout=timeout)
    except StoreError as exc:
        raise InspectError(str(exc)) from None
    try:
        return Live(client.address, client.stats(), client.list())
    except StoreError as exc:
        raise InspectError(f"kvstored at {client.address}: {exc}") from None
    finally:
        client.close()


# ---------------------------------------------------------------- the report


def _name(seq: SeqRecord) -> dict:
    return {"ns": seq.ns, "id": seq.name, "uid": seq.uid}


def _user(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _runs(cluster: np.ndarray) -> int:
    """Stretches of consecutive slots holding one cluster."""
    return 0 if len(cluster) == 0 else 1 + int(np.count_nonzero(cluster[1:] != cluster[:-1]))


def _page_runs(pages: np.ndarray) -> int:
    """Stretches of consecutive slots holding consecutive pages (token order)."""
    return 0 if len(pages) == 0 else 1 + int(np.count_nonzero(np.diff(pages) != 1))


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 2) if b else None


def select_sequences(sequences: list[SeqRecord], spec: str | None) -> list[SeqRecord]:
    if spec is None:
        return sequences
    # Names may hold '/', so match the whole "ns/id" rather than splitting it.
    found = [s for s in sequences if f"{s.ns}/{s.name}" == spec]
    if not found:
        raise InspectError(f"no sequence {spec} in the store")
    return found


def find_partition(layout: Layout, spec: str) -> Partition:
    try:
        seq_spec, layer, head = spec.rsplit(":", 2)
        key_lh = (int(layer), int(head))
    except ValueError:
        raise InspectError(f"--partition wants NS/ID:LAYER:HEAD, got {spec!r}") from None
    seqs = select_sequences(layout.sequences, seq_spec)
    if len(seqs) > 1:
        raise InspectError(f"--partition {spec}: several sequences are named {seq_spec}")
    part = layout.partitions.get((seqs[0].uid, *key_lh))
    if part is None:
        g = seqs[0].geometry
        raise InspectError(
            f"sequence {seq_spec} stores nothing at layer {key_lh[0]} head {key_lh[1]} "
            f"(it has {g.num_layers} layers x {g.num_kv_heads} KV heads)"
        )
    return part


def ssd_report(layout: Layout | None, live: Live | None, cap: int | None) -> dict:
    if layout is None:
        s = live.stats  # type: ignore[union-attr]
        return {"used_bytes": s["ssd_used_bytes"], "extent_end": s["ssd_file_bytes"], "cap_bytes": cap,
                "free_bytes": max(0, cap - s["ssd_used_bytes"]) if cap else None}
    # Overlapping extents are catalog damage (reported as such); count the first of each overlap.
    starts, nbytes = layout.used_ranges()
    if len(starts) > 1 and (starts[1:] < np.maximum.accumulate(starts + nbytes)[:-1]).any():
        keep, reach = [], 0
        for i, (start, n) in enumerate(zip(starts.tolist(), nbytes.tolist())):
            if start >= reach:
                keep.append(i)
                reach = start + n
        starts, nbytes = starts[keep], nbytes[keep]
    alloc = ExtentAllocator.from_spans(cap or UNBOUNDED, starts, nbytes)
    holes = alloc.holes
    hole_bytes = sum(n for _, n in holes)
    tail = max(0, layout.file_bytes - alloc.end)
    return {
        "used_bytes": alloc.used_bytes, "file_bytes": layout.file_bytes, "extent_end": alloc.end,
        "cap_bytes": cap, "free_bytes": max(0, alloc.capacity - alloc.used_bytes) if cap else None,
        "extents": sum(p.num_extents() for p in layout.partitions.values()),
        "catalog_problems": layout.problems, "num_holes": len(holes),
        "largest_hole_bytes": max((n for _, n in holes), default=0), "hole_bytes": hole_bytes,
        "tail_bytes": tail, "free_in_file_bytes": hole_bytes + tail, "holes": [list(h) for h in holes],
    }


def live_sequence_reports(live: Live, ns_id: str | None) -> list[dict]:
    """What the daemon's list says, for when its directory cannot be read here."""
    rows = live.sequences
    if ns_id is not None:
        rows = [d for d in rows if f"{d['ns']}/{d['seq']}" == ns_id]
        if not rows:
            raise InspectError(f"no sequence {ns_id} at {live.address}")
    return [{"ns": d["ns"], "id": d["seq"], "uid": d["uid"], "owner": d.get("owner"), "user": None,
             "geometry": d["geometry"], "complete_pages": d["complete_pages"],
             "blocks": d["num_blocks"], "bytes": d["bytes"], "dram_blocks": d["dram_blocks"]} for d in rows]


def sequence_reports(selected: list[SeqRecord], partitions: list[Partition], live: Live | None) -> list[dict]:
    dram = {d["uid"]: d.get("dram_blocks") for d in live.sequences} if live else {}
    by_uid: dict[int, list[Partition]] = {}
    for part in partitions:
        by_uid.setdefault(part.seq.uid, []).append(part)
    out = []
    for seq in selected:
        g = seq.geometry
        mine = by_uid.get(seq.uid, [])
        parts = [p.describe() for p in mine]
        blocks = sum(p["pages"] for p in parts)
        runs = sum(p["runs"] for p in parts)
        out.append({
            **_name(seq), "owner": seq.owner, "user": _user(seq.owner),
            "geometry": g.to_dict(), "block_bytes": g.block_bytes, "created": seq.created,
            "complete_pages": _complete_pages(g, mine), "blocks": blocks, "bytes": blocks * g.block_bytes,
            "partitions": len(parts), "extents": sum(p["extents"] for p in parts), "runs": runs,
            "mean_run": _ratio(blocks, runs), "page_runs": sum(p["page_runs"] for p in parts),
            "dram_blocks": dram.get(seq.uid) if live else None,
        })
    return out


def _complete_pages(g: Geometry, parts: list[Partition]) -> int:
    """Pages 0..n-1 stored for every (layer, KV head), as the daemon counts them."""
    if len(parts) < g.num_layers * g.num_kv_heads:
        return 0
    prefix = None
    for part in parts:
        pages = np.unique(part.pages())
        gaps = np.flatnonzero(pages != np.arange(len(pages)))
        n = int(gaps[0]) if len(gaps) else len(pages)
        prefix = n if prefix is None else min(prefix, n)
    return prefix or 0


# ---------------------------------------------------------------- verify


@dataclass
class BadBlock:
    seq: SeqRecord
    ext: ExtentRecord
    slot: int
    why: str = ""

    @property
    def offset(self) -> int:
        return self.ext.offset + self.slot * self.seq.geometry.block_bytes

    def line(self) -> str:
        e = self.ext
        text = f"{self.seq.ns}/{self.seq.name} layer {e.layer} head {e.head} page {int(e.pages[self.slot])} at offset {self.offset}"
        return f"{text} ({self.why})" if self.why else text

    def to_dict(self) -> dict:
        e = self.ext
        return {**_name(self.seq), "layer": e.layer, "head": e.head, "page": int(e.pages[self.slot]),
                "offset": self.offset, "problem": self.why or "checksum"}


class Progress:
    """Percent of bytes verified, on stderr: one line redrawn on a terminal, else a line per second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = max(total, 1), enabled
        self.tty = sys.stderr.isatty()
        self.interval = PROGRESS_INTERVAL_S if self.tty else 1.0
        self.done = 0
        self._shown = 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self._shown >= self.interval:
            self._shown = now
            text = f"verify: {100 * self.done / self.total:5.1f}% of {_format_size(self.total)}"
            sys.stderr.write(f"\r{text}" if self.tty else f"{text}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def verify(layout: Layout, selected: list[SeqRecord], progress: bool) -> dict:
    """Re-read every block of ``selected`` and check it as a get does: CRC-32C xor address tag."""
    from kvstored.checksum import block_crcs  # noqa: PLC0415 - numba loads slowly; only verify needs it
    from kvstored.copy import address_tags  # noqa: PLC0415

    uids = {s.uid for s in selected}
    work = sorted(((p.seq, e) for p in layout.partitions.values() if p.seq.uid in uids for e in p.records),
                  key=lambda se: se[1].offset)
    blocks = [p for p in layout.partitions.values() if p.seq.uid in uids and p.blocks is not None]
    total = sum(len(e.pages) * s.geometry.block_bytes for s, e in work)
    total += sum(len(p.blocks.offsets) * p.seq.geometry.block_bytes for p in blocks)
    meter = Progress(total, progress)
    bad: list[BadBlock] = []
    t0 = time.monotonic()
    fd = os.open(layout.data_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(READ_CHUNK)
        for seq, ext in work:
            bb = seq.geometry.block_bytes
            step = max(1, READ_CHUNK // bb)
            if step * bb > len(buf):
                buf = bytearray(step * bb)
            for first in range(0, len(ext.pages), step):
                slots = np.arange(first, min(first + step, len(ext.pages)))
                got, why = _pread(fd, buf, len(slots) * bb, ext.offset + first * bb)
                whole = got // bb
                ok = slots[:whole]
                tags = address_tags(seq.uid, np.full(whole, ext.layer), np.full(whole, ext.head), ext.pages[ok])
                crc = block_crcs(np.frombuffer(buf, np.uint8, whole * bb), (ok - first) * bb, bb) ^ tags
                bad.extend(BadBlock(seq, ext, int(s)) for s in ok[crc != ext.crc[ok]])
                bad.extend(BadBlock(seq, ext, int(s), why) for s in slots[whole:])
                meter.add(len(slots) * bb)
        for seq in {p.seq.uid: p.seq for p in blocks}.values():
            bad.extend(_verify_blocks(fd, seq, [p for p in blocks if p.seq is seq], meter))
    finally:
        os.close(fd)
        meter.close()
    bad.sort(key=lambda b: b.offset)
    stale = _changed_since(layout, bad)
    kept = [b for b in bad if id(b.ext) not in stale]
    num = sum(len(e.pages) for _, e in work) + sum(len(p.blocks.offsets) for p in blocks)
    return {"blocks": num, "bytes": total, "seconds": round(time.monotonic() - t0, 3),
            "skipped_changed": len(bad) - len(kept), "bad": kept}


def _verify_blocks(fd: int, seq: SeqRecord, parts: list[Partition], meter: Progress) -> list[BadBlock]:
    """Check every part of a block namespace's blocks (``parts``, read as columns), in file
    order, :data:`READ_CHUNK` bytes a read where they lie close together."""
    from kvstored.checksum import block_crcs  # noqa: PLC0415
    from kvstored.copy import address_tags  # noqa: PLC0415

    bb = seq.geometry.block_bytes
    offs = np.concatenate([p.blocks.offsets for p in parts])
    which = np.concatenate([np.full(len(p.blocks.offsets), j) for j, p in enumerate(parts)])
    at = np.concatenate([np.arange(len(p.blocks.offsets)) for p in parts])
    order = np.argsort(offs, kind="stable")
    offs, which, at = offs[order], which[order], at[order]
    layers = np.array([p.layer for p in parts])[which]
    slots = np.concatenate([p.blocks.slots for p in parts])[order]
    expect = np.concatenate([p.blocks.crcs for p in parts])[order]
    step = max(1, READ_CHUNK // bb)
    bad = []
    buf = bytearray(max(READ_CHUNK, bb))
    for first in range(0, len(offs), step):
        i = np.arange(first, min(first + step, len(offs)))
        if offs[i[-1]] + bb - offs[i[0]] > len(buf):  # far apart: a read each
            groups = [i[k:k + 1] for k in range(len(i))]
        else:
            groups = [i]
        for g in groups:
            base = int(offs[g[0]])
            got, why = _pread(fd, buf, int(offs[g[-1]]) + bb - base, base)
            whole = offs[g] + bb - base <= got
            ok = g[whole]
            tags = address_tags(seq.uid, layers[ok], np.zeros(len(ok), np.int64), slots[ok])
            crc = block_crcs(np.frombuffer(buf, np.uint8, got), offs[ok] - base, bb) ^ tags
            for k, problem in [(k, "") for k in ok[crc != expect[ok]].tolist()] + [(k, why) for k in g[~whole].tolist()]:
                part = parts[which[k]]
                bad.append(BadBlock(seq, part.blocks.record(seq.uid, part.layer, int(at[k])), 0, problem))
        meter.add(len(i) * bb)
    return bad


def _pread(fd: int, buf: bytearray, nbytes: int, offset: int) -> tuple[int, str]:
    """Read ``nbytes`` at ``offset`` into ``buf``; returns the bytes read and, if short, why."""
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        try:
            n = os.preadv(fd, [view[done:nbytes]], offset + done)
        except OSError as exc:
            return done, f"unreadable: {exc.strerror}"
        if n == 0:
            return done, "past the end of the data file"
        done += n
    return done, ""


def _changed_since(layout: Layout, bad: list[BadBlock]) -> set[int]:
    """Extents of ``bad`` that a running daemon deleted after the snapshot: their space may hold new data."""
    gone = set()
    with layout.catalog.env.begin() as txn:
        for b in bad:
            if layout.catalog.extent_offset(txn, b.ext) != b.ext.offset:
                gone.add(id(b.ext))
    return gone


# ---------------------------------------------------------------- picture


def draw_partition(part: Partition, path: Path) -> None:
    """One strip of slots in file order, coloured by cluster id; white lines between extents."""
    try:
        import matplotlib  # noqa: PLC0415 - an optional extra
    except ImportError:
        raise InspectError("--png needs matplotlib: pip install 'kvdrive[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib.colors import ListedColormap  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    cluster = np.concatenate([e.cluster for e in part.extents])
    ids, dense = np.unique(cluster, return_inverse=True)
    if len(ids) <= 20:
        palette = matplotlib.colormaps["tab10" if len(ids) <= 10 else "tab20"].colors
        cmap = ListedColormap(palette[: len(ids)])
    else:
        cmap = matplotlib.colormaps["turbo"].resampled(len(ids))
    fig = Figure(figsize=(12, 2.2 if len(ids) <= 20 else 1.8), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(dense[None, :], aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=-0.5, vmax=len(ids) - 0.5, extent=(0, len(cluster), 0, 1))
    bounds = np.cumsum([len(e.pages) for e in part.extents])[:-1]
    if len(bounds) <= 500:
        for x in bounds:
            ax.axvline(x, color="white", linewidth=0.8)
    ax.set_yticks([])
    ax.set_xlabel("slot (extents in file order)")
    d = part.describe()
    ax.set_title(f"{part.seq.ns}/{part.seq.name} layer {part.layer} head {part.head}: {d['pages']} pages in "
                 f"{d['extents']} extents, {d['clusters']} clusters in {d['runs']} runs (mean run {d['mean_run']})")
    if len(ids) <= 20:
        bar = fig.colorbar(image, ax=ax, ticks=range(len(ids)), pad=0.01)
        bar.ax.set_yticklabels([str(i) for i in ids.tolist()])
        bar.set_label("cluster")
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise InspectError(f"cannot write {path}: {exc.strerror}") from None


# ---------------------------------------------------------------- text output


TEXT_COLUMNS = {"NS/ID", "OWNER", "GEOMETRY"}


def _owner(s: dict) -> str | None:
    if s.get("owner") is None:
        return None
    return f"{s['owner']} ({s['user']})" if s.get("user") else str(s["owner"])


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    left = [h in TEXT_COLUMNS for h in headers]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if lj else v.rjust(w) for v, w, lj in zip(values, widths, left)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def _geometry(g: dict) -> str:
    return f"{g['num_layers']}x{g['num_kv_heads']}x{g['head_dim']} {g['dtype']} p{g['page_size']}"


def _block_counts(layout: Layout | None, live: Live | None) -> dict:
    """Engine blocks and their namespaces (each namespace is a sequence of the reserved name)."""
    if layout is not None:
        from kvstored.catalog import BLOCKS_NAME  # noqa: PLC0415

        return {"namespaces": sum(s.name == BLOCKS_NAME for s in layout.sequences), "blocks": layout.num_blocks}
    return {"namespaces": live.stats.get("block_namespaces"), "blocks": live.stats.get("blocks")}  # type: ignore[union-attr]


def print_text(report: dict, show_partitions: bool) -> None:
    st, ssd, dram = report["store"], report["ssd"], report["dram"]
    where = [st["dir"] or "(store directory not read: give DIR)"]
    if st["address"]:
        where.append(f"live: kvstored pid {st['pid']} at {st['address']}")
    print(f"store  {'; '.join(where)} (format {st['format']})")
    if st["format"] != FORMAT_VERSION:
        print(f"       format {st['format']}: a kvstored of format {FORMAT_VERSION} migrates its catalog in place at its "
              "first start (docs/durability.md)")
    fs = _format_size
    cap = f"cap {fs(ssd['cap_bytes'])}, {fs(ssd['free_bytes'])} free" if ssd["cap_bytes"] else "cap unknown (give --ssd-max)"
    if "file_bytes" in ssd:
        print(f"SSD    used {fs(ssd['used_bytes'])} in {ssd['extents']} extents; file {fs(ssd['file_bytes'])}; {cap}")
        print(f"       holes: {ssd['num_holes']} (largest {fs(ssd['largest_hole_bytes'])}, {fs(ssd['hole_bytes'])} in all) "
              f"+ {fs(ssd['tail_bytes'])} past the last extent = {fs(ssd['free_in_file_bytes'])} free inside the file")
        for problem in ssd["catalog_problems"]:
            print(f"       warning: catalog damaged: {problem} (left out here; its space counts as free)")
    else:
        print(f"SSD    used {fs(ssd['used_bytes'])}, extents end at {fs(ssd['extent_end'])}; {cap}")
    if dram is not None:
        print(f"DRAM   used {fs(dram['used_bytes'])} of {fs(dram['cap_bytes'])} ({dram['blocks']} blocks)")
    eb = report["engine_blocks"]
    print(f"BLOCKS {eb['blocks']} engine blocks in {eb['namespaces']} block namespaces (the sequences named ' blocks')")
    print()
    live = st["address"] is not None
    headers = ["NS/ID", "UID", "OWNER", "GEOMETRY", "COMPLETE PAGES", "BLOCKS", "BYTES", "EXTENTS", "RUNS", "MEAN RUN"] + (["DRAM"] if live else [])
    rows = [[f"{s['ns']}/{s['id']}", s["uid"], _owner(s), _geometry(s["geometry"]), s["complete_pages"], s["blocks"], fs(s["bytes"]),
             s.get("extents"), s.get("runs"), s.get("mean_run")] + ([s["dram_blocks"]] if live else [])
            for s in report["sequences"]]
    print(_table(headers, rows) if rows else "no sequences")
    if show_partitions and "partitions" in report:
        print()
        print(_table(["NS/ID", "LAYER", "HEAD", "EXTENTS", "PAGES", "BYTES", "CLUSTERS", "RUNS", "MEAN RUN", "PAGE RUNS"],
                     [[f"{p['ns']}/{p['id']}", p["layer"], p["head"], p["extents"], p["pages"], fs(p["bytes"]),
                       p["clusters"], p["runs"], p["mean_run"], p["page_runs"]] for p in report["partitions"]]))
    if "partition" in report:
        p = report["partition"]
        print(f"\npartition {p['ns']}/{p['id']} layer {p['layer']} head {p['head']}: {p['pages']} pages in "
              f"{p['extents']} extents, {p['clusters']} clusters in {p['runs']} runs")
        print(_table(["OFFSET", "BYTES", "PAGES", "FIRST PAGE", "LAST PAGE", "CLUSTERS", "RUNS", "PAGE RUNS"],
                     [[e["offset"], fs(e["bytes"]), e["pages"], e["first_page"], e["last_page"], e["clusters"],
                       e["runs"], e["page_runs"]] for e in p["extent_list"]]))
    if "verify" in report:
        v = report["verify"]
        print()
        for problem in v["catalog_problems"]:
            print(f"catalog damaged: {problem}")
        for b in v["bad_lines"]:
            print(b)
        verdict = f"{len(v['bad'])} bad of {v['blocks']} blocks" if v["bad"] else f"all {v['blocks']} blocks intact"
        if v["catalog_problems"]:
            verdict += f", but the catalog has {len(v['catalog_problems'])} problem(s)"
        skipped = f"; {v['skipped_changed']} skipped (deleted while verifying)" if v["skipped_changed"] else ""
        print(f"verify: {verdict} ({fs(v['bytes'])} read in {v['seconds']:.2f} s{skipped})")
    if "png" in report:
        print(f"\nwrote {report['png']}")


def _extent_rows(part: Partition) -> list[dict]:
    bb = part.seq.geometry.block_bytes
    return [{"offset": e.offset, "bytes": len(e.pages) * bb, "pages": len(e.pages),
             "first_page": int(e.pages.min()), "last_page": int(e.pages.max()),
             "clusters": len(np.unique(e.cluster)), "runs": _runs(e.cluster),
             "page_runs": _page_runs(e.pages)} for e in part.extents if len(e.pages)]


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Show how a KVDrive store lays out its KV blocks: sequences, bytes per tier, extents and "
        "cluster contiguity per (sequence, layer, KV head) partition, free space and fragmentation. "
        "DIR (the daemon's --ssd directory) is read directly, its catalog opened read-only as a registered LMDB reader, "
        "so it is safe whether or not kvstored runs on it; "
        "--address asks a running kvstored for its live figures (DRAM tier, SSD cap) and, when it reports a "
        "directory readable here, shows that store's layout as well.",
        epilog="Exit status: 0 success; 1 --verify found damaged blocks or a damaged catalog; 2 usage or store errors "
        "(not a store, another format version, unknown sequence or partition, no daemon at the address).",
    )
    add_version_option(p)
    p.add_argument("dir", nargs="?", type=Path, metavar="DIR", help="store directory (kvstored --ssd DIR)")
    p.add_argument("--address", nargs="?", const="", metavar="ADDR",
                   help="a running kvstored, ipc://PATH or tcp://HOST:PORT; with no ADDR, the daemon "
                        f"kvdrive_client.connect() reaches: ${ADDRESS_ENV} if set, else ipc://{default_runtime_dir() / SOCKET_NAME} "
                        f"(where kvstored listens without --listen), else ipc://{SYSTEM_SOCKET} if only that one exists"),
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the daemon (default 5)")
    p.add_argument("--ssd-max", metavar="SIZE", help="the daemon's --ssd-max, for free space of a stopped store "
                   "(a live daemon reports its own)")
    p.add_argument("--sequence", metavar="NS/ID", help="only this sequence (tier figures stay store-wide)")
    p.add_argument("--partitions", action="store_true", help="add the per-partition table (in --json: a 'partitions' list)")
    p.add_argument("--partition", metavar="NS/ID:LAYER:HEAD", help="list one partition's extents (offset, pages, clusters, runs)")
    p.add_argument("--png", type=Path, metavar="FILE", help="draw --partition's slots coloured by cluster id (needs matplotlib)")
    p.add_argument("--verify", action="store_true", help="check the catalog as the daemon does at open (record "
                   "checksums, counts, cross references; each problem printed as 'catalog damaged: ...'), re-read every "
                   "block (of --sequence, if given) and check its checksum as the daemon does; print each bad one as 'NS/ID layer L head H page P at offset O' "
                   "and exit 1 if any (blocks of a sequence deleted meanwhile are skipped)")
    p.add_argument("--progress", action="store_true", help="show --verify progress on stderr even when it is not a terminal")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    return p


def run(args: argparse.Namespace) -> int:
    if args.png and not args.partition:
        raise InspectError("--png needs --partition NS/ID:LAYER:HEAD")
    if args.dir is None and args.address is None:
        raise InspectError("give a store directory DIR, --address [ADDR] (no ADDR: the default daemon), or both")
    from kvstored.catalog import CatalogDamagedError, CatalogMissingError  # noqa: PLC0415
    from kvstored.config import parse_size  # noqa: PLC0415

    try:
        cap = parse_size(args.ssd_max) if args.ssd_max else None
    except ValueError as exc:
        raise InspectError(f"--ssd-max: {exc}") from None
    live = query_daemon(args.address, args.timeout) if args.address is not None else None
    ssd_dir = args.dir
    if ssd_dir is None and live is not None and live.stats.get("ssd_dir"):
        reported = Path(live.stats["ssd_dir"])
        ssd_dir = reported if os.access(reported / META_DIR, os.R_OK | os.X_OK) else None
    if live is not None:
        cap = live.stats.get("ssd_max_bytes", cap)
        served = live.stats.get("ssd_dir")
        if args.dir is not None and served and Path(served) != args.dir.resolve():
            print(f"{PROG}: note: the daemon at {live.address} serves {served}, not {args.dir}", file=sys.stderr)
    try:
        layout = open_layout(ssd_dir) if ssd_dir is not None else None
    except (CatalogDamagedError, CatalogMissingError) as exc:
        if not args.verify:
            raise InspectError(str(exc)) from None
        return _damaged_catalog(args, exc)
    if layout is None and (args.verify or args.partitions or args.partition):
        raise InspectError("--verify, --partitions and --partition need the store directory: give DIR")
    try:
        return _report(args, layout, live, cap)
    finally:
        if layout is not None:
            layout.catalog.close()


def _report(args: argparse.Namespace, layout: Layout | None, live: Live | None, cap: int | None) -> int:
    if layout is not None:
        selected = select_sequences(layout.sequences, args.sequence)
        uids = {s.uid for s in selected}
        parts = sorted((p for p in layout.partitions.values() if p.seq.uid in uids),
                       key=lambda p: (p.seq.ns, p.seq.name, p.layer, p.head))
        sequences = sequence_reports(selected, parts, live)
    else:
        sequences = live_sequence_reports(live, args.sequence)  # type: ignore[arg-type]
    report: dict = {
        "store": {"dir": str(layout.ssd_dir) if layout else None, "address": live.address if live else None,
                  "pid": live.stats.get("pid") if live else None,
                  "format": layout.catalog.format if layout else live.stats.get("format", FORMAT_VERSION)},
        "ssd": ssd_report(layout, live, cap),
        "dram": {"cap_bytes": live.stats["dram_bytes"], "used_bytes": live.stats["dram_used_bytes"],
                 "blocks": live.stats["dram_blocks"]} if live else None,
        "sequences": sequences,
        "engine_blocks": _block_counts(layout, live),
    }
    if layout is not None and args.partitions:
        report["partitions"] = [p.describe() for p in parts]
    if layout is not None and args.partition:
        part = find_partition(layout, args.partition)
        report["partition"] = {**part.describe(), "extent_list": _extent_rows(part)}
        if args.png:
            draw_partition(part, args.png)
            report["png"] = str(args.png)
    exit_code = 0
    if layout is not None and args.verify:
        v = verify(layout, selected, args.progress or sys.stderr.isatty())
        bad = v.pop("bad")
        report["verify"] = {**v, "bad": [b.to_dict() for b in bad], "bad_lines": [b.line() for b in bad],
                            "catalog_problems": layout.problems}
        exit_code = 1 if bad or layout.problems else 0
    if args.json:
        report.get("verify", {}).pop("bad_lines", None)
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_text(report, args.partitions)
    return exit_code


def _damaged_catalog(args: argparse.Namespace, exc: CatalogDamagedError | CatalogMissingError) -> int:
    """--verify of a catalog that cannot be read at all: its damage is the finding (exit 1)."""
    problems = getattr(exc, "problems", [str(exc)])
    if args.json:
        json.dump({"verify": {"catalog_problems": problems, "bad": [], "blocks": 0}}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for problem in problems:
            print(f"catalog damaged: {problem}")
        print(f"verify: the catalog cannot be read, so no block was checked ({exc})")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except InspectError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (`| head`) went away; stop quietly, and keep Python's exit flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
