"""The SSD read engines: Linux AIO and the preadv thread pool read the same bytes."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest

from kvdrive_client import Geometry
from kvstored.io_engine import AioEngine, AlignedScratch, PosixEngine, choose_engine, probe_aio

AIO_OK, AIO_WHY = probe_aio()
needs_aio = pytest.mark.skipif(not AIO_OK, reason=AIO_WHY)
BLOCK = 4096


def _direct_supported(directory) -> bool:
    probe = directory / "direct-probe"
    probe.write_bytes(b"\0" * BLOCK)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def data_file(tmp_path):
    """A 4 MiB file of random bytes, open for reading (O_DIRECT where the file system allows)."""
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "data"
    path.write_bytes(data.tobytes())
    flags = os.O_RDONLY | (os.O_DIRECT if _direct_supported(tmp_path) else 0)
    fd = os.open(path, flags)
    yield fd, data
    os.close(fd)


def _ranges(rng, n, file_bytes):
    """``n`` aligned reads of 1 to 4 blocks at random places, and where each lands in a scratch buffer."""
    sizes = rng.integers(1, 5, n) * BLOCK
    starts = rng.integers(0, (file_bytes - 4 * BLOCK) // BLOCK, n) * BLOCK
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return starts.astype(np.int64), (starts + sizes).astype(np.int64), offs.astype(np.int64)


def _check(dst, data, starts, ends, offs):
    for s, e, o in zip(starts, ends, offs):
        np.testing.assert_array_equal(dst[o : o + e - s], data[s:e])


def _read_and_check(engine, fd, data, seed, n):
    starts, ends, offs = _ranges(np.random.default_rng(seed), n, len(data))
    dst = AlignedScratch().get(int(offs[-1] + ends[-1] - starts[-1]))
    dst[:] = 0
    try:
        engine.read_into(fd, starts, ends, dst, offs)
    finally:
        engine.close()
    _check(dst, data, starts, ends, offs)


@needs_aio
@pytest.mark.parametrize("make", [AioEngine, lambda: PosixEngine(4)], ids=["aio", "posix"])
def test_each_engine_reads_every_range_into_place(data_file, make):
    _read_and_check(make(), *data_file, seed=1, n=40)


@needs_aio
def test_aio_submits_more_reads_than_its_depth_in_waves(data_file):
    _read_and_check(AioEngine(depth=4), *data_file, seed=2, n=23)


@needs_aio
def test_aio_short_read_names_its_offset_and_leaves_the_engine_usable(data_file):
    fd, data = data_file
    starts = np.array([0, len(data) - BLOCK, 8 * BLOCK], dtype=np.int64)
    ends = starts + np.array([BLOCK, 2 * BLOCK, BLOCK])  # the second runs past the end of the file
    offs = np.array([0, BLOCK, 3 * BLOCK], dtype=np.int64)
    engine = AioEngine()
    dst = AlignedScratch().get(4 * BLOCK)
    try:
        with pytest.raises(OSError, match=f"short read at offset {len(data) - BLOCK}: {BLOCK} of {2 * BLOCK} bytes"):
            engine.read_into(fd, starts, ends, dst, offs)
        # Every read of the failed call was reaped: the next call sees only its own completions.
        engine.read_into(fd, starts[[0, 2]], ends[[0, 2]], dst, offs[[0, 2]])
    finally:
        engine.close()
    _check(dst, data, starts[[0, 2]], ends[[0, 2]], offs[[0, 2]])


@needs_aio
def test_aio_on_a_closed_descriptor_raises(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * BLOCK)
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    engine = AioEngine()
    try:
        with pytest.raises(OSError, match="Bad file descriptor"):
            engine.read_into(fd, np.array([0]), np.array([BLOCK]), AlignedScratch().get(BLOCK), np.array([0]))
    finally:
        engine.close()


@needs_aio
def test_aio_threads_reap_only_their_own_reads(data_file):
    fd, data = data_file
    engine = AioEngine()
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            scratch = AlignedScratch()  # one buffer per thread, as the daemon's get workers have
            for _ in range(20):
                starts, ends, offs = _ranges(rng, 12, len(data))
                dst = scratch.get(int(offs[-1] + ends[-1] - starts[-1]))
                engine.read_into(fd, starts, ends, dst, offs)
                _check(dst, data, starts, ends, offs)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    assert not errors, errors


@needs_aio
def test_auto_takes_aio_only_on_an_o_direct_file(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("kvstored.io_engine.probe_kvikio", lambda: (False, "no CUDA driver (test)"))
    with caplog.at_level(logging.INFO, logger="kvstored.io_engine"):
        direct = choose_engine("auto", 4, str(tmp_path / "data"), direct=True)
        buffered = choose_engine("auto", 4, str(tmp_path / "data"), direct=False)
    direct.close(), buffered.close()
    assert isinstance(direct, AioEngine) and type(buffered) is PosixEngine
    assert "I/O engine: Linux AIO" in caplog.text
    assert "Linux AIO not used: the data file is not open with O_DIRECT" in caplog.text
    with pytest.raises(RuntimeError, match="--engine aio asked for, but the data file is not open with O_DIRECT"):
        choose_engine("aio", 4, str(tmp_path / "data"), direct=False)
    with pytest.raises(ValueError, match="unknown I/O engine 'uring'"):
        choose_engine("uring", 4, str(tmp_path / "data"))


@pytest.mark.parametrize("engine", ["aio", "posix"])
def test_daemon_serves_ssd_gets_with_each_engine(daemon_factory, tmp_path, engine):
    if engine == "aio" and not (AIO_OK and _direct_supported(tmp_path)):
        pytest.skip(f"Linux AIO needs O_DIRECT here: {AIO_WHY}, O_DIRECT supported: {_direct_supported(tmp_path)}")
    d = daemon_factory(dram="0", extra=["--engine", engine]).start()
    c = d.client()
    assert c.stats()["engine"] == {"aio": "linux-aio", "posix": "posix-preadv"}[engine]
    geom = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(2, 2, 30, geom.block_bytes), dtype=np.uint8)
    seq = c.create("t", "engine", geom)
    c.put(seq, range(2), range(30), data, cluster=rng.integers(0, 4, (2, 2, 30)))
    blocks = np.array([(l, h, p) for l in range(2) for h in range(2) for p in range(30)])[rng.permutation(120)[:70]]
    np.testing.assert_array_equal(c.get(seq, blocks), data[blocks[:, 0], blocks[:, 1], blocks[:, 2]])
    counters = c.stats()["counters"]
    assert counters["blocks_ssd"] == 70 and 0 < counters["ssd_reads"] < 70


def _fake_kvikio(monkeypatch, gds):
    """A driver that loads and a kvikio whose cuFile answers ``gds`` (an exception: raises it)."""
    import sys
    import types

    from kvstored import io_engine

    monkeypatch.setattr(io_engine.ctypes, "CDLL", lambda name: object())
    class Properties:
        @property
        def is_gds_available(self):
            if isinstance(gds, Exception):
                raise gds
            return gds

    props = Properties()
    kvikio = types.ModuleType("kvikio")
    kvikio.cufile_driver = types.SimpleNamespace(properties=props)
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    return io_engine.probe_kvikio()


def test_kvikio_is_chosen_only_where_cufile_reports_gpudirect_storage(monkeypatch):
    ok, why = _fake_kvikio(monkeypatch, True)
    assert ok and "GPUDirect Storage active" in why
    ok, why = _fake_kvikio(monkeypatch, False)
    assert not ok and "not active" in why
    ok, why = _fake_kvikio(monkeypatch, RuntimeError("cuFileDriverOpen failed"))
    assert not ok and "cuFileDriverOpen failed" in why
