"""kvstore-inspect against stores written by a real kvstored."""

from __future__ import annotations

import json
import subprocess
import sys

import lmdb
import numpy as np
import pytest

from kvdrive.layout.format import DATA_FILE, META_DIR
from kvdrive.tools.inspect import main
from kvdrive_client import Geometry
from kvstored.catalog import Catalog

GEOM = Geometry(num_layers=2, num_kv_heads=3, head_dim=64, dtype="float16", page_size=16)
PAGES = 24
SCRATCH_PAGES = 8


def inspect(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvdrive.tools.inspect", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def inspect_json(*args) -> dict:
    out = inspect(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def fill(d) -> np.ndarray:
    """A deleted sequence below two kept ones; t/prompt's pages carry cluster ids, returned."""
    rng = np.random.default_rng(0)
    c = d.client()
    scratch = c.create("t", "scratch", GEOM)
    c.put(scratch, range(2), range(SCRATCH_PAGES), rng.integers(0, 256, (2, 3, SCRATCH_PAGES, GEOM.block_bytes), dtype=np.uint8))
    seq = c.create("t", "prompt", GEOM)
    cluster = rng.integers(0, 4, (2, 3, PAGES))
    c.put(seq, range(2), range(PAGES), rng.integers(0, 256, (2, 3, PAGES, GEOM.block_bytes), dtype=np.uint8), cluster=cluster)
    other = c.create("u", "other", GEOM)
    c.put(other, range(2), [0], np.ones((2, 3, 1, GEOM.block_bytes), np.uint8))
    c.delete("t", "scratch")
    return cluster


@pytest.fixture
def stopped(daemon_factory):
    d = daemon_factory().start()
    cluster = fill(d)
    assert d.stop() == 0
    return d, cluster


def fails(capsys, *args) -> str:
    """Runs the tool in this process (quicker than a subprocess); it must fail with one line on stderr."""
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore-inspect: ") and err.count("\n") == 1, err
    return err


def test_layout_of_a_stopped_store(stopped, tmp_path, capsys, monkeypatch):
    d, cluster = stopped
    bb = GEOM.block_bytes
    whole = inspect_json(d.ssd)
    assert [(s["ns"], s["id"], s["blocks"]) for s in whole["sequences"]] == [("t", "prompt", 2 * 3 * PAGES), ("u", "other", 2 * 3)]
    doc = inspect_json(d.ssd, "--partitions", "--ssd-max", "1G", "--sequence", "t/prompt")
    (seq,) = doc["sequences"]
    assert (seq["ns"], seq["id"], seq["complete_pages"]) == ("t", "prompt", PAGES)
    assert seq["blocks"] == 2 * 3 * PAGES and seq["bytes"] == 2 * 3 * PAGES * bb and seq["dram_blocks"] is None
    assert doc["dram"] is None
    parts = doc["partitions"]
    assert sorted((p["layer"], p["head"]) for p in parts) == [(l, h) for l in range(2) for h in range(3)]
    for p in parts:
        distinct = len(np.unique(cluster[p["layer"], p["head"]]))
        assert (p["extents"], p["pages"]) == (1, PAGES)
        # One put packs each cluster into one run.
        assert p["runs"] == p["clusters"] == distinct
        assert p["mean_run"] == round(PAGES / distinct, 2)
    ssd = doc["ssd"]
    freed = 2 * 3 * SCRATCH_PAGES * bb
    assert ssd["holes"] == [[0, freed]] and ssd["largest_hole_bytes"] == freed
    assert ssd["used_bytes"] == 2 * 3 * (PAGES + 1) * bb
    assert ssd["free_in_file_bytes"] == freed + ssd["tail_bytes"]
    assert ssd["free_bytes"] == (1 << 30) - ssd["used_bytes"]

    png = tmp_path / "partition.png"
    text = inspect(d.ssd, "--partition", "t/prompt:1:2", "--png", png)
    assert text.returncode == 0, text.stderr
    assert "t/prompt" in text.stdout and "holes: 1" in text.stdout and f"wrote {png}" in text.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000

    assert "no sequence t/nope" in fails(capsys, d.ssd, "--sequence", "t/nope")
    assert "stores nothing at layer 5 head 0" in fails(capsys, d.ssd, "--partition", "t/prompt:5:0")
    assert "NS/ID:LAYER:HEAD" in fails(capsys, d.ssd, "--partition", "t/prompt")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "needs matplotlib" in fails(capsys, d.ssd, "--partition", "t/prompt:0:0", "--png", tmp_path / "x.png")


def test_verify_names_exactly_the_damaged_block(stopped):
    d, _ = stopped
    clean = inspect_json(d.ssd, "--verify")
    assert clean["verify"]["blocks"] == 2 * 3 * (PAGES + 1) and clean["verify"]["bad"] == []
    uid = next(s["uid"] for s in clean["sequences"] if s["id"] == "prompt")

    catalog = Catalog(d.ssd / META_DIR, 1 << 30, durable=False, readonly=True)
    try:
        ext = next(e for e in list(catalog.iter_extents()) if (e.uid, e.layer, e.head) == (uid, 1, 2))
    finally:
        catalog.close()
    slot = 5
    page = int(ext.pages[slot])
    block_at = ext.offset + slot * GEOM.block_bytes
    with open(d.ssd / DATA_FILE, "r+b") as f:
        f.seek(block_at + 100)
        byte = f.read(1)
        f.seek(block_at + 100)
        f.write(bytes([byte[0] ^ 0x40]))

    damaged = inspect(d.ssd, "--verify", "--sequence", "t/prompt")
    assert damaged.returncode == 1
    expect = f"t/prompt layer 1 head 2 page {page} at offset {block_at}"
    assert [line for line in damaged.stdout.splitlines() if " at offset " in line] == [expect]
    assert f"1 bad of {2 * 3 * PAGES} blocks" in damaged.stdout


def test_verify_checks_the_catalog_as_the_daemon_does(stopped):
    d, _ = stopped
    env = lmdb.open(str(d.ssd / META_DIR), max_dbs=4)
    with env.begin(write=True) as txn:  # one flipped byte in t/prompt's name key, below the catalog's encoding
        seqs = env.open_db(b"seqs", txn=txn, create=False)
        key, value = next((k, v) for k, v in txn.cursor(db=seqs) if k.startswith(b"n:") and k.endswith(b"prompt"))
        txn.delete(key, db=seqs)
        txn.put(key[:-1] + b"X", value, db=seqs)
    env.close()
    checked = inspect(d.ssd, "--verify")
    assert checked.returncode == 1, checked
    damage = [line for line in checked.stdout.splitlines() if line.startswith("catalog damaged: ")]
    assert damage and "'t/prompX'" in damage[0] and "checksum mismatch" in damage[0], checked.stdout
    doc = json.loads(inspect(d.ssd, "--verify", "--json").stdout)
    assert any("checksum mismatch" in p for p in doc["verify"]["catalog_problems"])
    # Without --verify the layout of what is intact is shown, with the damage as a warning.
    plain = inspect(d.ssd)
    assert plain.returncode == 0 and "warning: catalog damaged" in plain.stdout, plain


def test_live_daemon_by_address(daemon_factory):
    d = daemon_factory().start()
    fill(d)
    client = d.client()
    # The daemon reports its directory, so the layout comes with the live figures.
    doc = inspect_json("--address", d.address, "--partitions", "--sequence", "t/prompt")
    assert doc["store"]["address"] == d.address and doc["store"]["dir"] == str(d.ssd.resolve())
    (seq,) = doc["sequences"]
    assert (seq["ns"], seq["id"]) == ("t", "prompt")
    assert doc["dram"]["cap_bytes"] == 64 << 20 and doc["dram"]["used_bytes"] > 0
    assert seq["dram_blocks"] == 2 * 3 * PAGES
    assert len(doc["partitions"]) == 2 * 3 and doc["ssd"]["cap_bytes"] == 4 << 30
    text = inspect("--address", d.address, d.ssd, "--verify")
    assert text.returncode == 0 and "DRAM" in text.stdout and "t/prompt" in text.stdout, text.stderr
    # Reading the catalog beside the daemon leaves its writes alone.
    seq = client.open("t", "prompt")
    assert client.put(seq, range(2), [PAGES], np.zeros((2, 3, 1, GEOM.block_bytes), np.uint8)) == 2 * 3


def test_clear_errors(tmp_path, capsys):
    out = inspect(tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not a KVDrive store" in out.stderr, out.stderr
    assert "no such directory" in fails(capsys, tmp_path / "missing")
    assert "no kvstored answers" in fails(capsys, "--address", f"ipc://{tmp_path / 'none.sock'}")
    store = tmp_path / "future"
    (store / META_DIR).mkdir(parents=True)
    (store / DATA_FILE).touch()
    env = lmdb.open(str(store / META_DIR), max_dbs=4)
    with env.begin(write=True) as txn:
        for name in (b"seqs", b"extents"):
            env.open_db(name, txn=txn)
        txn.put(b"format", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    assert "store format 99" in fails(capsys, store)


def test_help_names_every_mode(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("DIR", "--address", "--verify", "--json", "--sequence", "--partitions", "--partition", "--png", "--progress"):
        assert flag in text


def test_block_namespaces_read_as_columns_report_what_their_records_do(daemon_factory):
    """Engine blocks (1 and 4 parts, some deleted) beside a sequence: the layout read as columns
    and record by record agree, and --verify names a damaged block's part either way."""
    from kvdrive.tools.inspect import open_layout, sequence_reports, ssd_report, verify

    d = daemon_factory(dram="0").start()
    c = d.client()
    fill(d)
    bb = 16 << 10
    for ns, regions in (("one", 1), ("four", 4)):
        buf = c._staging_buffer(30 * bb)
        buf.array[: 30 * bb] = np.random.default_rng(regions).integers(0, 256, 30 * bb, dtype=np.uint8)
        offsets = [j * bb + r * (bb // regions) for j in range(30) for r in range(regions)]
        keys = [b"k%d" % i for i in range(30)]
        c.block_put_async(ns, bb, keys, buf, offsets=offsets, regions=regions).wait()
        c.block_delete(ns, keys[::4])
    assert d.stop() == 0

    def reports(columns: bool) -> tuple:
        layout = open_layout(d.ssd, columns)
        try:
            parts = sorted(layout.partitions.values(), key=lambda p: (p.seq.ns, p.seq.name, p.layer, p.head))
            v = verify(layout, layout.sequences, False)
            bad = [b.to_dict() for b in v.pop("bad")]
            v.pop("seconds")
            return (sequence_reports(layout.sequences, parts, None), ssd_report(layout, None, 1 << 30),
                    [p.describe() for p in parts], v, bad, layout.num_blocks,
                    sum(p.blocks is not None for p in parts))
        finally:
            layout.catalog.close()

    fast, slow = reports(True), reports(False)
    assert fast[-1] == 1 + 4 and slow[-1] == 0  # the block namespaces' parts, read as columns
    assert fast[:-1] == slow[:-1] and fast[5] == 2 * 22 and fast[4] == []

    layout = open_layout(d.ssd)
    part = layout.partitions[(next(s.uid for s in layout.sequences if s.ns == "four"), 2, 0)]
    at, page, uid = int(part.blocks.offsets[7]), int(part.blocks.slots[7]), part.seq.uid
    layout.catalog.close()
    with open(d.ssd / DATA_FILE, "r+b") as f:
        f.seek(at + 10)
        byte = f.read(1)
        f.seek(at + 10)
        f.write(bytes([byte[0] ^ 0x01]))
    fast, slow = reports(True), reports(False)
    assert fast[4] == slow[4] == [{"ns": "four", "id": " blocks", "uid": uid, "layer": 2, "head": 0, "page": page, "offset": at,
                                   "problem": "checksum"}]
