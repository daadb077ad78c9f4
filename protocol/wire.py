"""The wire protocol between kvstored and its clients, shared by both sides.

Transport: ZeroMQ, the daemon's ROUTER against a client's DEALER. A request is a
multipart message: frame 0 is a msgpack map ``{"v": PROTOCOL_VERSION, "op": ...,
"id": ...}`` plus the op's fields; further frames carry fixed-dtype arrays that
the header names (block lists, cluster ids, importance). KV bytes never travel on
the socket: they move through buffers the client registered (shared memory on a
CPU host, CUDA IPC on a GPU).

A reply is one msgpack frame ``{"v", "id", "ok": True, ...}`` or
``{"v", "id", "ok": False, "code": ErrorCode, "error": text}``. Replies to one
client may arrive in any order; ``id`` pairs them with requests.

This module holds what both sides must agree on: the version, the ops, the error
codes, the limits and the frame encoding. The daemon's checking of requests is in
``kvstored.protocol``; the client turns replies into its own errors.
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "BLOCK_ARRAYS",
    "BUFFER_KIND_CUDA_IPC",
    "BUFFER_KIND_MEMFD",
    "BUFFER_KIND_POOL",
    "BadReplyError",
    "CUDA_IPC_HANDLE_BYTES",
    "ErrorCode",
    "GET_ARRAYS",
    "MAX_BLOCK_KEY_BYTES",
    "MAX_BLOCK_KEYS",
    "MAX_BUFFER_BYTES",
    "MAX_CUDA_DEVICE",
    "MAX_HEADER_BYTES",
    "MAX_LAYERS_PER_PUT",
    "MAX_LIST",
    "MAX_LOOKUP",
    "MAX_NAME_BYTES",
    "MAX_SEQS_PER_GET",
    "Op",
    "PROTOCOL_VERSION",
    "PUT_ARRAYS",
    "SESSION_TOKEN_BYTES",
    "decode_reply",
    "encode",
    "error_reply",
    "ok_reply",
    "request_frames",
]

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 << 10
MAX_NAME_BYTES = 256
MAX_LAYERS_PER_PUT = 1 << 12
# Distinct sequences one get's 'seqs' may name (a micro-batch's rows); the store groups
# blocks by sequence and looks each one up, so this bounds a get's per-sequence work.
MAX_SEQS_PER_GET = 1024
SESSION_TOKEN_BYTES = 16
# Sequences in one list reply at most (a client pages with 'after').
MAX_LIST = 1000
# Names in one lookup at most (an engine's prefix of block keys, asked in one request).
MAX_LOOKUP = 1024
# Engine blocks (the block_* ops): keys in one request at most, and bytes per key (so
# that a request's keys, about 50 KiB at most, fit in its header; a longer engine key is
# sent as its hash, see kvdrive_client.integrations.blocks.key_bytes).
MAX_BLOCK_KEYS = 1024
MAX_BLOCK_KEY_BYTES = 48
# Registered buffers (session socket 'register'): sizes and offsets are bounded by this.
MAX_BUFFER_BYTES = 1 << 44
# Buffer kinds of a 'register': a sealed memfd (the default; "shm" is another name for
# it), or a CUDA allocation named by its IPC handle. hello's 'cuda_ipc' says whether
# the daemon can open CUDA IPC handles.
BUFFER_KIND_MEMFD = "memfd"
BUFFER_KIND_CUDA_IPC = "cuda_ipc"
# An unsealed shared-memory file (memfd or /dev/shm) the daemon maps under a SIGBUS
# guard (a serving engine's CPU KV pool; see docs/protocol.md).
BUFFER_KIND_POOL = "pool"
# sizeof(cudaIpcMemHandle_t): the handle travels as these bytes, unchanged.
CUDA_IPC_HANDLE_BYTES = 64
# Device ordinals a cuda_ipc register may name (the daemon refuses one it does not have).
MAX_CUDA_DEVICE = 1023


class Op(enum.Enum):
    HELLO = "hello"
    CREATE = "create"
    OPEN = "open"
    LIST = "list"
    DELETE = "delete"
    PUT = "put"
    GET = "get"
    STATS = "stats"
    LOOKUP = "lookup"
    BLOCK_LOOKUP = "block_lookup"
    BLOCK_PUT = "block_put"
    BLOCK_GET = "block_get"
    BLOCK_DELETE = "block_delete"


class ErrorCode(enum.Enum):
    BAD_MESSAGE = "bad_message"
    BAD_VERSION = "bad_version"
    UNKNOWN_OP = "unknown_op"
    BAD_FIELD = "bad_field"
    TOO_LARGE = "too_large"
    OUT_OF_RANGE = "out_of_range"
    NOT_FOUND = "not_found"
    EXISTS = "exists"
    BUFFER = "buffer"
    FULL = "full"
    CHECKSUM = "checksum"
    IO = "io"
    UNSUPPORTED = "unsupported"
    CUDA_UNAVAILABLE = "cuda_unavailable"
    SESSION = "session"
    EXPIRED = "expired"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


# Array frames each op may carry, with their dtypes.
PUT_ARRAYS = {"cluster": np.int32, "order": np.int32, "importance": np.float32}
GET_ARRAYS = {"blocks": np.int32, "dst": np.int64, "seqs": np.int64}
BLOCK_ARRAYS = {"offsets": np.int64}


class BadReplyError(ValueError):
    """A reply frame that is not of this protocol (another version, or not a reply at all)."""


def encode(header: dict, arrays: list[np.ndarray] | None = None) -> list:
    frames: list = [msgpack.packb(header, use_bin_type=True)]
    for a in arrays or ():
        frames.append(memoryview(np.ascontiguousarray(a)).cast("B"))
    return frames


def request_frames(op: Op, req_id: int, fields: dict, arrays: dict[str, np.ndarray] | None = None,
                   session: bytes | None = None, deadline: float | None = None) -> list:
    header = {"v": PROTOCOL_VERSION, "op": op.value, "id": req_id, **fields}
    if session is not None:
        header["session"] = session
    if deadline is not None:
        header["deadline"] = deadline
    names = list(arrays or {})
    if names:
        header["frames"] = names
    return encode(header, [arrays[n] for n in names] if arrays else None)


def ok_reply(req_id: Any, **fields: Any) -> list:
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **fields})


def error_reply(req_id: Any, code: ErrorCode, message: str) -> list:
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": code.value, "error": message})


def decode_reply(frame: bytes) -> dict:
    try:
        reply = msgpack.unpackb(frame, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadReplyError(f"a reply that is not msgpack: {exc}") from None
    if not isinstance(reply, dict) or reply.get("v") != PROTOCOL_VERSION:
        raise BadReplyError(f"reply of an unknown protocol (not version {PROTOCOL_VERSION}): {reply!r:.200}")
    return reply
