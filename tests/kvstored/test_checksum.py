"""CRC-32C block checksums: the hardware and table kernels against a bitwise reference."""

import numpy as np
import pytest

from kvstored import checksum
from kvstored.checksum import block_crcs, crc32c, verify_scatter


def bitwise_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


KERNELS = [checksum._crcs_table] + ([checksum._crcs_hw] if checksum.HARDWARE else [])


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("nbytes", [1, 7, 8, 13, 64, 4099, 8192])
def test_kernels_match_the_reference_for_any_size_and_alignment(kernel, nbytes):
    rng = np.random.default_rng(nbytes)
    buf = np.frombuffer(rng.bytes(1 << 16), dtype=np.uint8)
    offs = rng.integers(0, len(buf) - nbytes, 9).astype(np.int64)  # 9: two groups of four and a single block
    out = np.empty(len(offs), dtype=np.uint32)
    kernel(buf, offs, nbytes, out, checksum._TABLES)
    assert out.tolist() == [bitwise_crc32c(bytes(buf[o : o + nbytes])) for o in offs]


def test_blocks_outside_the_buffer_are_refused():
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        block_crcs(buf, np.array([60]), 8)
    with pytest.raises(ValueError, match="outside"):
        block_crcs(buf, np.array([-1]), 8)
    assert len(block_crcs(buf, np.array([], dtype=np.int64), 8)) == 0


def test_verify_scatter_copies_only_blocks_whose_checksum_holds():
    rng = np.random.default_rng(3)
    nbytes = 256
    src = np.frombuffer(rng.bytes(8 * nbytes), dtype=np.uint8).copy()
    src_offs = np.arange(8, dtype=np.int64) * nbytes
    tags = rng.integers(0, 2**32, 8).astype(np.uint32)
    expect = block_crcs(src, src_offs, nbytes) ^ tags
    src[3 * nbytes + 17] ^= 0x40  # damage block 3 after its checksum was taken
    dst = np.zeros(8 * nbytes, dtype=np.uint8)
    dst_offs = src_offs[::-1].copy()
    ok = verify_scatter(src, src_offs, dst, dst_offs, nbytes, tags, expect)
    assert ok.tolist() == [True, True, True, False, True, True, True, True]
    for i in range(8):
        got = dst[dst_offs[i] : dst_offs[i] + nbytes]
        if i == 3:
            assert not got.any()
        else:
            np.testing.assert_array_equal(got, src[src_offs[i] : src_offs[i] + nbytes])
