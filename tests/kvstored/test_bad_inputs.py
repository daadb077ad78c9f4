"""Malformed and out-of-range requests: each gets an error reply naming the problem, and the daemon carries on."""

from __future__ import annotations

import math
import re

import msgpack
import numpy as np
import pytest
import zmq

from kvdrive.layout.geometry import MAX_PAGES
from kvdrive_client import Geometry, StoreError
from kvstored import protocol
from kvstored.protocol import MAX_SEQS_PER_GET, PROTOCOL_VERSION, ErrorCode, ProtocolError, parse_request

GEOM = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
BB = GEOM.block_bytes
STORED_PAGES = 4
BUF_SIZE = 1 << 20


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def i32(*rows) -> bytes:
    return np.asarray(rows, dtype=np.int32).tobytes()


def i64(*values) -> bytes:
    return np.asarray(values, dtype=np.int64).tobytes()


def f32(*values) -> bytes:
    return np.asarray(values, dtype=np.float32).tobytes()


# Each case: (header fields over {"v", "id"} or raw frames, extra frames, expected code, message pattern).
# Placeholders: "$SEQ" the sequence uid, "$BUF" the registered buffer id; "$DROP" leaves a field out.
# Every header carries the client's session token unless the case sets (or drops) "session".
PUT = {"op": "put", "seq": "$SEQ", "layers": [0], "pages": [10], "buf": "$BUF", "offset": 0}
GET = {"op": "get", "seq": "$SEQ", "buf": "$BUF", "offset": 0, "frames": ["blocks"]}
GOOD_BLOCK = i32((0, 0, 0))

CASES = {
    # -- framing
    "garbage bytes": (b"\xc1\xc1 not msgpack at all", [], "bad_message", "not msgpack"),
    "empty frame": (b"", [], "bad_message", "not msgpack"),
    "msgpack list": (packed([1, 2, 3]), [], "bad_message", "msgpack map"),
    "msgpack integer": (packed(7), [], "bad_message", "msgpack map"),
    "header too large": (packed({"v": 1, "op": "hello", "id": 1, "pad": "x" * (70 << 10)}), [], "too_large", "header is"),
    "id is a string": (packed({"v": 1, "op": "hello", "id": "one"}), [], "bad_field", "'id'"),
    "negative id": (packed({"v": 1, "op": "hello", "id": -4}), [], "bad_field", "'id'"),
    # -- version and op
    "wrong version": ({"v": 2, "op": "hello"}, [], "bad_version", "version 2"),
    "no version": ({"v": None, "op": "hello"}, [], "bad_version", "version None"),
    "version is true": ({"v": True, "op": "hello"}, [], "bad_version", "version True"),
    "version is a float": ({"v": 1.0, "op": "hello"}, [], "bad_version", "version 1.0"),
    "unknown op": ({"op": "frobnicate"}, [], "unknown_op", "frobnicate"),
    "op missing": ({}, [], "unknown_op", "unknown op None"),
    "op not a string": ({"op": 3}, [], "unknown_op", "unknown op 3"),
    # -- sessions and deadlines
    "no session token": ({"op": "stats", "session": "$DROP"}, [], "session", "'session' must be the 16-byte token"),
    "session token too short": ({"op": "stats", "session": b"abc"}, [], "session", "16-byte token"),
    "session token not bytes": ({"op": "stats", "session": "x" * 16}, [], "session", "16-byte token"),
    "unknown session token": ({"op": "stats", "session": b"\0" * 16}, [], "session", "no open session with this token"),
    "deadline not a number": ({"op": "stats", "deadline": "soon"}, [], "bad_field", "'deadline' must be a number"),
    "deadline a bool": ({"op": "stats", "deadline": True}, [], "bad_field", "'deadline' must be a number"),
    "deadline passed": ({"op": "stats", "deadline": 1.0}, [], "expired", "deadline passed"),
    "register on the zmq socket": ({"op": "register", "kind": "shm", "name": "x", "size": 4096}, [], "unsupported", "session socket"),
    "unregister on the zmq socket": ({"op": "unregister", "buf": 1}, [], "unsupported", "session socket"),
    # -- sequences
    "create geometry missing": ({"op": "create", "ns": "t", "seq": "s"}, [], "bad_field", "geometry"),
    "create geometry bad dtype": ({"op": "create", "ns": "t", "seq": "s", "geometry": {**GEOM.to_dict(), "dtype": "int4"}}, [], "bad_field", "dtype 'int4'"),
    "create geometry dtype an integer": ({"op": "create", "ns": "t", "seq": "s", "geometry": {**GEOM.to_dict(), "dtype": 5}}, [], "bad_field", "dtype must be a string"),
    "create geometry dtype a list": ({"op": "create", "ns": "t", "seq": "s", "geometry": {**GEOM.to_dict(), "dtype": ["float16"]}}, [], "bad_field", "dtype must be a string"),
    "create geometry layers past 2^63": ({"op": "create", "ns": "t", "seq": "s", "geometry": {**GEOM.to_dict(), "num_layers": 1 << 63}}, [], "bad_field", "num_layers"),
    "create geometry zero layers": ({"op": "create", "ns": "t", "seq": "s", "geometry": {**GEOM.to_dict(), "num_layers": 0}}, [], "bad_field", "num_layers"),
    "create geometry extra field": ({"op": "create", "ns": "t", "seq": "s", "geometry": {**GEOM.to_dict(), "rope": 1}}, [], "bad_field", "unknown \\['rope'\\]"),
    "create name with space": ({"op": "create", "ns": "t", "seq": "a b", "geometry": GEOM.to_dict()}, [], "bad_field", "'seq' must be"),
    "create ns not a string": ({"op": "create", "ns": 1, "seq": "s", "geometry": GEOM.to_dict()}, [], "bad_field", "'ns' must be"),
    "create exist_ok not a bool": ({"op": "create", "ns": "t", "seq": "s", "geometry": GEOM.to_dict(), "exist_ok": 1}, [], "bad_field", "'exist_ok' must be a boolean"),
    "create existing sequence": ({"op": "create", "ns": "bad", "seq": "target", "geometry": GEOM.to_dict()}, [], "exists", "bad/target exists"),
    "open unknown sequence": ({"op": "open", "ns": "bad", "seq": "nope"}, [], "not_found", "no sequence bad/nope"),
    "delete unknown sequence": ({"op": "delete", "ns": "bad", "seq": "nope"}, [], "not_found", "no sequence bad/nope"),
    "delete uid not an integer": ({"op": "delete", "ns": "bad", "seq": "target", "uid": "1"}, [], "bad_field", "'uid' must be an integer"),
    "delete uid negative": ({"op": "delete", "ns": "bad", "seq": "target", "uid": -1}, [], "out_of_range", "'uid' = -1"),
    "delete uid of another": ({"op": "delete", "ns": "bad", "seq": "target", "uid": 1}, [], "not_found", "with uid 1 "),
    "list ns too long": ({"op": "list", "ns": "n" * 300}, [], "bad_field", "'ns' must be"),
    # -- put
    "put seq missing": ({**PUT, "seq": "$DROP"}, [], "bad_field", "'seq' is missing"),
    "put layers missing": ({**PUT, "layers": "$DROP"}, [], "bad_field", "'layers' is missing"),
    "put layers not a list": ({**PUT, "layers": 0}, [], "bad_field", "'layers' must be a list"),
    "put layers empty": ({**PUT, "layers": []}, [], "bad_field", "'layers' must be a list"),
    "put layers hold a float": ({**PUT, "layers": [0.5]}, [], "bad_field", "'layers' must hold integers"),
    "put layers repeat": ({**PUT, "layers": [1, 1]}, [], "bad_field", "'layers' repeats"),
    "put negative page": ({**PUT, "pages": [-1]}, [], "out_of_range", "'pages' has values outside"),
    "put page past the limit": ({**PUT, "pages": [MAX_PAGES]}, [], "out_of_range", "'pages' has values outside"),
    "put page past 2^63": ({**PUT, "pages": [1 << 63]}, [], "out_of_range", "'pages' has values outside"),
    "put page 2^64 - 1": ({**PUT, "pages": [3, (1 << 64) - 1]}, [], "out_of_range", "'pages' has values outside"),
    "put layer past 2^63": ({**PUT, "layers": [1 << 63]}, [], "out_of_range", "'layers' has values outside"),
    "put layer past geometry": ({**PUT, "layers": [4]}, [], "out_of_range", "layer 4 >= num_layers 4"),
    "put seq is a string": ({**PUT, "seq": "abc"}, [], "bad_field", "'seq' must be an integer"),
    "put negative offset": ({**PUT, "offset": -8}, [], "out_of_range", "'offset' = -8"),
    "put huge offset": ({**PUT, "offset": 1 << 50}, [], "out_of_range", "'offset'"),
    "put offset past buffer": ({**PUT, "offset": BUF_SIZE - BB}, [], "buffer", "source buffer .* too small"),
    "put source too small": ({**PUT, "layers": [0, 1, 2, 3], "pages": list(range(10, 10 + 100))}, [], "buffer", "too small"),
    "put unknown sequence": ({**PUT, "seq": 12345}, [], "not_found", "no sequence with uid 12345"),
    "put unregistered buffer": ({**PUT, "buf": 999}, [], "buffer", "buffer 999 is not registered"),
    "put stored page again": ({**PUT, "pages": [1]}, [], "exists", "write-once"),
    "put cluster wrong length": ({**PUT, "frames": ["cluster"]}, [i32(1, 2, 3)], "bad_message", "'cluster' has 3 values for 2 blocks"),
    "put importance nan": ({**PUT, "frames": ["importance"]}, [f32(math.nan, 1.0)], "bad_field", "NaN"),
    "put unknown array": ({**PUT, "frames": ["blocks"]}, [GOOD_BLOCK], "bad_field", "'blocks' is unknown"),
    "put frames not a list": ({**PUT, "frames": "cluster"}, [], "bad_field", "'frames' must be a list"),
    # -- get
    "get seq missing": ({**GET, "seq": "$DROP"}, [GOOD_BLOCK], "bad_field", "'seq' is missing"),
    "get no blocks frame": ({**GET, "frames": []}, [], "bad_field", "needs a 'blocks' array"),
    "get blocks named but absent": (GET, [], "bad_message", "names 1 array frames, message carries 0"),
    "get frame not named": ({**GET, "frames": ["blocks"]}, [GOOD_BLOCK, GOOD_BLOCK], "bad_message", "names 1 array frames, message carries 2"),
    "get blocks not whole rows": (GET, [i32(0, 0, 0, 1)], "bad_message", "N > 0 rows"),
    "get blocks empty": (GET, [b""], "bad_message", "N > 0 rows"),
    "get blocks ragged bytes": (GET, [b"\0" * 5], "bad_message", "whole number of int32"),
    "get negative page": (GET, [i32((0, 0, -1))], "out_of_range", "negative"),
    "get layer past geometry": (GET, [i32((0, 0, 0), (7, 0, 0))], "out_of_range", "block 1: layer 7 >= 4"),
    "get head past geometry": (GET, [i32((0, 2, 0))], "out_of_range", "block 0: head 2 >= 2"),
    "get page never stored": (GET, [i32((0, 0, 0), (1, 1, STORED_PAGES))], "not_found", "1 of 2 blocks are not stored, first \\(layer 1, head 1, page 4\\)"),
    "get page far past the end": (GET, [i32((0, 0, MAX_PAGES * 64))], "not_found", "not stored"),
    "get unknown sequence": ({**GET, "seq": 4242}, [GOOD_BLOCK], "not_found", "no sequence with uid 4242"),
    "get unregistered buffer": ({**GET, "buf": 777}, [GOOD_BLOCK], "buffer", "buffer 777 is not registered"),
    "get buf is a float": ({**GET, "buf": 1.5}, [GOOD_BLOCK], "bad_field", "'buf' must be an integer"),
    "get destination too small": ({**GET, "offset": BUF_SIZE - BB + 1}, [GOOD_BLOCK], "buffer", "destination buffer .* too small"),
    "get dst past buffer": ({**GET, "frames": ["blocks", "dst"]}, [GOOD_BLOCK, i64(BUF_SIZE)], "buffer", "destination buffer .* too small"),
    "get dst huge": ({**GET, "frames": ["blocks", "dst"]}, [GOOD_BLOCK, i64(1 << 62)], "buffer", "too small"),
    "get dst negative": ({**GET, "frames": ["blocks", "dst"]}, [GOOD_BLOCK, i64(-BB)], "out_of_range", "negative offset"),
    "get dst length mismatch": ({**GET, "frames": ["blocks", "dst"]}, [i32((0, 0, 0), (0, 0, 1)), i64(0)], "bad_message", "'dst' has 1 offsets for 2 blocks"),
    "get dst wrong dtype size": ({**GET, "frames": ["blocks", "dst"]}, [GOOD_BLOCK, b"\0" * 4], "bad_message", "whole number of int64"),
    "get repeated frame": ({**GET, "frames": ["blocks", "blocks"]}, [GOOD_BLOCK, GOOD_BLOCK], "bad_field", "repeated"),
    "get seqs length mismatch": ({**GET, "frames": ["blocks", "seqs"]}, [i32((0, 0, 0), (0, 0, 1)), i64(0)], "bad_message", "'seqs' has 1 uids for 2 blocks"),
    "get seqs negative": ({**GET, "frames": ["blocks", "seqs"]}, [GOOD_BLOCK, i64(-1)], "out_of_range", "negative uid"),
    "get seqs too many sequences": ({**GET, "frames": ["blocks", "seqs"]}, [i32(*[(0, 0, 0)] * (MAX_SEQS_PER_GET + 1)), i64(*range(MAX_SEQS_PER_GET + 1))], "too_large", f"names {MAX_SEQS_PER_GET + 1} sequences, limit {MAX_SEQS_PER_GET}"),
    "get seqs unknown sequence": ({**GET, "frames": ["blocks", "seqs"]}, [GOOD_BLOCK, i64(4242)], "not_found", "no sequence with uid 4242"),
}


class RawSocket:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def request(self, frames: list[bytes], timeout_ms: int = 10_000) -> dict:
        self.sock.send_multipart(frames)
        assert self.sock.poll(timeout_ms, zmq.POLLIN), "no reply from kvstored"
        reply = self.sock.recv_multipart()
        assert len(reply) == 1
        return msgpack.unpackb(reply[0], raw=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def substitute(value, ids: dict):
    if isinstance(value, str) and value in ids:
        return ids[value]
    return value


@pytest.fixture(scope="module")
def served(module_daemon):
    """One daemon for the whole table, with a stored sequence and a registered buffer."""
    d = module_daemon
    client = d.client()
    seq = client.create("bad", "target", GEOM)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (4, 2, STORED_PAGES, BB), dtype=np.uint8)
    client.put(seq, range(4), range(STORED_PAGES), data)
    buf = client.register(BUF_SIZE)
    raw = RawSocket(d.address)
    yield d, client, seq, data, buf, raw
    raw.close()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_request_gets_an_error_reply(served, case):
    d, client, seq, _, buf, raw = served
    header, extra, code, pattern = CASES[case]
    if isinstance(header, bytes):
        # Raw frames: the id cannot be read (or the header is refused before decoding).
        frames, req_id = [header], None
    else:
        ids = {"$SEQ": seq.uid, "$BUF": buf.buf_id}
        fields = {"session": client.session().token, **header}
        fields = {k: substitute(v, ids) for k, v in fields.items() if v != "$DROP"}
        req_id = 1000 + list(CASES).index(case)
        frames = [packed({"v": PROTOCOL_VERSION, "id": req_id, **fields}), *extra]
    reply = raw.request(frames)
    assert reply["ok"] is False, reply
    assert reply["v"] == PROTOCOL_VERSION
    assert reply["id"] == req_id
    assert reply["code"] == code, reply
    assert re.search(pattern, reply["error"]), reply["error"]
    assert d.alive()


def test_daemon_serves_normally_after_the_table(served):
    d, client, seq, data, buf, raw = served
    assert d.alive()
    blocks = np.array([(l, h, p) for l in range(4) for h in range(2) for p in range(STORED_PAGES)])
    np.testing.assert_array_equal(client.get(seq, blocks), data.reshape(-1, BB))
    fresh = np.random.default_rng(1).integers(0, 256, (4, 2, 2, BB), dtype=np.uint8)
    assert client.put(seq, range(4), [STORED_PAGES, STORED_PAGES + 1], fresh) == 16
    got = client.get(seq, [(3, 1, STORED_PAGES + 1), (0, 0, STORED_PAGES)])
    np.testing.assert_array_equal(got, [fresh[3, 1, 1], fresh[0, 0, 0]])
    # A raw request of the right form still works on the socket that sent all the bad ones.
    reply = raw.request([packed({"v": PROTOCOL_VERSION, "op": "hello", "id": 5})])
    assert reply["ok"] is True and reply["id"] == 5 and reply["pid"] == d.proc.pid


def test_unreadable_id_is_answered_with_id_none(served):
    _, client, _, _, _, raw = served
    for frame in (b"\xff\xfe", packed(["v", 1]), packed({"v": 1, "op": "hello", "id": True})):
        reply = raw.request([frame])
        assert reply["id"] is None and reply["ok"] is False
    # The SDK surfaces such a reply as an error of the next call instead of hanging.
    client._sock.send(b"\xff\xfe")
    with pytest.raises(StoreError, match=r"\[bad_message\] header is not msgpack"):
        client.stats()
    assert client.stats()["sequences"] >= 1


def test_an_unexpected_parser_exception_is_bad_message_with_the_id(monkeypatch):
    def broken(*_):
        raise KeyError("a gap in the parser")

    monkeypatch.setattr(protocol, "_parse_op", broken)
    with pytest.raises(ProtocolError) as err:
        parse_request([packed({"v": PROTOCOL_VERSION, "op": "hello", "id": 77})], 1 << 20, 1 << 10)
    assert err.value.code is ErrorCode.BAD_MESSAGE and err.value.req_id == 77
    assert "KeyError" in str(err.value)
