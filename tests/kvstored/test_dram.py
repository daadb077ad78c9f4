"""The DRAM tier's slot allocator."""

from kvstored.dram import CHUNK_BYTES, DramTier


def test_has_room_tracks_free_slots_and_chunks():
    bb = 64 << 10
    tier = DramTier(2 * CHUNK_BYTES)
    assert tier.has_room(bb)
    slots = tier.allocate(bb, 10_000)
    assert len(slots) == 2 * CHUNK_BYTES // bb and len(set(slots.tolist())) == len(slots)
    assert not tier.has_room(bb) and len(tier.allocate(bb, 1)) == 0
    tier.release(bb, slots[:1])
    assert tier.has_room(bb) and len(tier.allocate(bb, 5)) == 1
    assert not tier.has_room(bb) and not tier.has_room(bb // 2)  # no chunk left for another block size
    tier.close()
    assert not DramTier(0).has_room(bb)
