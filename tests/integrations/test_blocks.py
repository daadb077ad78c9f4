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


def test_keys_are_converted_alike_one_at_a_time_and_in_a_list():
    """The list form is the one the engines' calls take; it must name the very blocks the one-key form does."""
    from kvdrive_client.integrations.rows import key_bytes, keys_bytes

    class Text(str):
        pass

    keys = ["a", "x" * 48, "x" * 49, "é" * 24, "é" * 25, "\udc80", "", b"", b"k", b"y" * 48, b"y" * 49,
            bytearray(b"ba"), memoryview(b"mv"), 7, -1, Text("sub"), 64 * "f", (1, 2)]
    assert keys_bytes(keys) == [key_bytes(k) for k in keys]
    assert keys_bytes(iter(keys)) == keys_bytes(keys)
    assert len({*keys_bytes(keys)}) == len(keys) - 1  # only "" and b"" share a block key: each one's SHA-256
