"""How an engine block of any size maps onto kvstored blocks (pure: no daemon)."""

from __future__ import annotations

import pytest

from kvdrive_client.integrations.blocks import MAX_PART_BYTES, block_geometry

MIB = 1 << 20


@pytest.mark.parametrize("block_bytes", [1024, 2 * MIB, 18 * MIB, 64 * MIB])
def test_a_block_up_to_64_mib_is_one_kvstored_block_as_before(block_bytes):
    g = block_geometry(block_bytes)
    assert (g.num_layers, g.num_kv_heads, g.block_bytes) == (1, 1, block_bytes)


@pytest.mark.parametrize("block_bytes", [80 * MIB, 65 * MIB, 320 * MIB, 1 << 30, 2 << 30])
def test_a_larger_block_is_split_into_equal_parts_of_at_most_64_mib(block_bytes):
    g = block_geometry(block_bytes)
    assert g.num_layers > 1 and g.num_layers * g.block_bytes == block_bytes
    assert g.block_bytes <= MAX_PART_BYTES


@pytest.mark.parametrize("block_bytes, words", [(6, "multiple of 4"), (0, "positive"), ((2 << 30) + 4096, "over"),
                                                ((1 << 30) + 4, "does not split")])
def test_a_size_that_cannot_be_stored_is_refused_in_words(block_bytes, words):
    with pytest.raises(ValueError, match=words):
        block_geometry(block_bytes)


def test_an_engine_key_becomes_a_block_key_by_one_rule_one_at_a_time_or_in_a_list():
    """Bytes as they are and strings as UTF-8 up to 48 bytes; longer ones, empty ones and keys
    of any other type by a SHA-256 (ints and the like apart from every bytes and string key)."""
    import hashlib

    from kvdrive_client.integrations.rows import key_bytes, keys_bytes

    class Text(str):
        pass

    def hashed(raw):
        return b"h" + hashlib.sha256(raw).digest()

    want = {"a": b"a", "x" * 48: b"x" * 48, "x" * 49: hashed(b"x" * 49), "é" * 24: "é".encode() * 24,
            "é" * 25: hashed("é".encode() * 25), "\udc80": b"\xed\xb2\x80", "": hashed(b""), b"": hashed(b""),
            b"k": b"k", b"y" * 48: b"y" * 48, b"y" * 49: hashed(b"y" * 49), 7: b"\x007", -1: b"\x00-1",
            (1, 2): b"\x00(1, 2)", 64 * "f": hashed(64 * b"f")}
    keys = [*want, bytearray(b"ba"), memoryview(b"mv"), Text("sub"), bytearray(49)]
    expect = [*want.values(), b"ba", b"mv", b"sub", hashed(bytes(49))]
    assert keys_bytes(keys) == expect
    assert keys_bytes(iter(keys)) == expect
    assert [key_bytes(k) for k in keys] == expect


def test_a_string_key_hashed_lately_is_not_hashed_again_and_the_kept_ones_stay_bounded(monkeypatch):
    """SGLang converts a page's key for batch_exists and again for the get that follows: the
    second time it comes from the keys kept, the same bytes, and the kept ones stay within
    HASHED_KEPT, however many keys pass."""
    import hashlib

    from kvdrive_client.integrations import rows

    monkeypatch.setattr(rows, "HASHED_KEPT", 8)
    monkeypatch.setattr(rows, "_HASHED", rows._Hashed())
    keys = [f"{i:064x}" for i in range(20)]
    want = [b"h" + hashlib.sha256(k.encode()).digest() for k in keys]
    assert rows.keys_bytes(keys[:3]) == want[:3]

    def no_hash(*_):
        raise AssertionError("hashed again")

    with monkeypatch.context() as m:
        m.setattr(hashlib, "sha256", no_hash)
        assert rows.keys_bytes(keys[:3]) == want[:3]
        assert rows.keys_bytes(iter(keys[1:3])) == want[1:3]
    assert rows.keys_bytes(keys) == want
    assert len(rows._HASHED.young) + len(rows._HASHED.old) <= 8
    for _ in range(3):  # keys found in the old generation move to the young one, within the bound
        assert rows.keys_bytes(keys[16:20]) == want[16:20] and rows.keys_bytes(keys[12:16]) == want[12:16]
        assert len(rows._HASHED.young) + len(rows._HASHED.old) <= 8
    assert rows.keys_bytes([keys[19], b"raw", keys[18], "short", bytearray(b"ba")]) == \
        [want[19], b"raw", want[18], b"short", b"ba"]
