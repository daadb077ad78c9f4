"""The scheduler side's bounded memory of stored keys: exact within its bound, never a wrong hit."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from kvdrive_client.integrations.known_keys import BYTES_PER_KEY, DEFAULT_CAPACITY, KnownKeys


def test_it_holds_at_most_its_capacity_and_forgets_the_least_recently_asked():
    known = KnownKeys(8)
    hot = b"hot"
    known.add_stored([hot])
    for i in range(100):
        known.add_stored([i.to_bytes(4, "little")])
        assert known.stored(hot)  # asked all along: kept
        assert len(known) <= 8
    assert known.num_forgotten >= 100 - 8
    assert not known.stored((0).to_bytes(4, "little"))  # forgotten: not known, asked again


def test_a_key_never_stored_is_never_known_and_a_forgotten_one_is_not_known():
    known = KnownKeys(4)
    for i in range(1000):  # any number of keys pass through
        known.add_stored([f"k{i}".encode()])
        assert known.stored(f"k{i}".encode())
        assert not known.stored(f"never{i}".encode())
    known.forget([b"k999"])
    assert not known.stored(b"k999")
    with pytest.raises(ValueError, match="at least 2"):
        KnownKeys(1)


def test_its_memory_is_within_the_documented_bytes_per_key():
    capacity = 1 << 15
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        known = KnownKeys(capacity)
        tracemalloc.reset_peak()
        known.add_stored(os.urandom(36) for _ in range(4 * capacity))  # vLLM's offload keys: hash and group
        held = tracemalloc.get_traced_memory()[0] - before
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(known) <= capacity
    assert held <= BYTES_PER_KEY * capacity, f"{held / capacity:.0f} bytes per key"
    assert peak <= BYTES_PER_KEY * capacity * 1.5, f"peak {peak / capacity:.0f} bytes per key"
    assert DEFAULT_CAPACITY * BYTES_PER_KEY <= 32 << 20  # what docs/engines.md promises
