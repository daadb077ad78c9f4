"""lookup: many names of one namespace asked in one request, among the caller's own sequences."""

import numpy as np
import pytest

from kvdrive_client import Geometry, RequestError
from kvdrive.protocol import MAX_LOOKUP, Op

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)


def test_lookup_reports_each_name_and_the_stored_prefix(daemon):
    c = daemon.client()
    rng = np.random.default_rng(0)
    for name in ("k0", "k1", "k3"):
        s = c.create("eng", name, GEOM)
        c.put(s, [0], [0], rng.integers(0, 256, GEOM.block_bytes, dtype=np.uint8))
    c.create("eng", "k2-empty", GEOM)  # created, nothing stored yet
    r = c.lookup("eng", ["k0", "k1", "k2-empty", "k3", "nope"])
    assert r["prefix"] == 2
    assert r["pages"] == [1, 1, 0, 1, -1]
    assert r["uids"][4] == 0 and all(u > 0 for u in r["uids"][:4])
    assert c.lookup("eng", ["k0", "k1", "k2-empty"], min_pages=0)["prefix"] == 3
    assert c.lookup("other-ns", ["k0"])["prefix"] == 0
    assert c.stats()["counters"]["lookups"] >= 3


def test_lookup_of_more_names_than_one_request_takes_is_split(daemon):
    c = daemon.client()
    s = c.create("eng", "only", GEOM)
    c.put(s, [0], [0], np.zeros(GEOM.block_bytes, np.uint8))
    names = ["only"] * 3 + [f"absent-{i}" for i in range(MAX_LOOKUP + 10)]
    r = c.lookup("eng", names)
    assert len(r["pages"]) == len(names) and r["prefix"] == 3 and r["pages"][-1] == -1


def test_lookup_sees_only_the_callers_sequences(daemon):
    # A second user is out of reach here; a second session of the same user sees the same
    # sequences, and other namespaces never meet.
    a, b = daemon.client(), daemon.client()
    s = a.create("ns-a", "shared-name", GEOM)
    a.put(s, [0], [0], np.zeros(GEOM.block_bytes, np.uint8))
    assert b.lookup("ns-a", ["shared-name"])["prefix"] == 1
    assert b.lookup("ns-b", ["shared-name"])["pages"] == [-1]


@pytest.mark.parametrize("fields, words", [
    ({"ns": "eng", "seqs": []}, "must be a list of 1..1024 names"),
    ({"ns": "eng", "seqs": ["a"] * (MAX_LOOKUP + 1)}, "must be a list of 1..1024 names"),
    ({"ns": "eng", "seqs": ["has space"]}, "printable ASCII"),
    ({"ns": "eng", "seqs": [7]}, "printable ASCII"),
    ({"ns": "eng", "seqs": "k0"}, "must be a list"),
    ({"seqs": ["k0"]}, "'ns' is missing"),
    ({"ns": "eng", "seqs": ["k0"], "min_pages": -1}, "outside"),
])
def test_bad_lookups_are_refused_in_words(daemon, fields, words):
    c = daemon.client()
    with pytest.raises(RequestError, match=words):
        c.call(Op.LOOKUP, fields)
    assert c.lookup("eng", ["k0"])["pages"] == [-1]  # and the daemon serves on
