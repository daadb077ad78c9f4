"""The daemon's side of the control protocol: every request checked and parsed.

The wire format (transport, ops, error codes, limits, frames) is
:mod:`kvdrive.protocol`, shared with the client. Every field is checked here before
the store sees it; store-level checks (a layer past the sequence's geometry, a page
that was never put) raise :class:`ProtocolError` from the store with the same codes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from kvdrive.layout.geometry import MAX_LAYERS, MAX_PAGES, Geometry
from kvdrive.protocol.blocks import MAX_BLOCK_BYTES
from kvdrive.protocol import (
    BLOCK_ARRAYS, BUFFER_KIND_CUDA_IPC, BUFFER_KIND_MEMFD, BUFFER_KIND_POOL, CUDA_IPC_HANDLE_BYTES, MAX_BLOCK_KEY_BYTES, MAX_BLOCK_KEYS, MAX_BUFFER_BYTES, MAX_CUDA_DEVICE, GET_ARRAYS,
    MAX_HEADER_BYTES, MAX_LAYERS_PER_PUT, MAX_LIST, MAX_LOOKUP, MAX_NAME_BYTES, MAX_SEQS_PER_GET, PROTOCOL_VERSION,
    PUT_ARRAYS, SESSION_TOKEN_BYTES, ErrorCode, Op, encode, error_reply, ok_reply, request_frames,
)

# The daemon's code and its tests take the shared wire names from here too.
__all__ = [
    "GET_ARRAYS", "MAX_HEADER_BYTES", "MAX_LAYERS_PER_PUT", "MAX_LIST", "MAX_LOOKUP", "MAX_NAME_BYTES", "MAX_SEQS_PER_GET",
    "PROTOCOL_VERSION", "PUT_ARRAYS", "SESSION_TOKEN_BYTES", "ErrorCode", "Op", "encode", "error_reply", "ok_reply",
    "request_frames", "ProtocolError", "ErrorTally", "Hello", "Create", "OpenSeq", "ListSeqs", "Delete", "Put", "Get", "Stats", "Lookup",
    "Request", "Envelope", "parse_request", "RegisterMemfd", "RegisterPool", "RegisterCudaIpc", "parse_register",
    "MAX_IMPORTANCE", "clamp_importance", "BlockLookup", "BlockPut", "BlockGet", "BlockDelete", "BlockRequest",
]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[\x21-\x7e]{1,256}$")

# Importance hints are kept in [0, MAX_IMPORTANCE]: a value outside is clamped to it (a
# prefill's attention sums lie far inside), NaN and infinity are refused. Hints rank one
# user's blocks only; fair shares decide between users (kvstored/dram_shares.py).
MAX_IMPORTANCE = float(1 << 20)


class ProtocolError(Exception):
    """A request the daemon refuses; becomes an error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ErrorTally:
    """Error replies sent, by code, since the daemon started (any thread may count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(ErrorCode, 0)

    def add(self, code: ErrorCode | str) -> None:
        with self._lock:
            self._counts[ErrorCode(code)] += 1

    def snapshot(self) -> dict[ErrorCode, int]:
        with self._lock:
            return dict(self._counts)


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Hello:
    pass


@dataclass(frozen=True)
class Create:
    ns: str
    seq: str
    geometry: Geometry
    exist_ok: bool


@dataclass(frozen=True)
class OpenSeq:
    ns: str
    seq: str


@dataclass(frozen=True)
class ListSeqs:
    """The caller's sequences with uid > ``after``, at most ``limit`` per reply."""

    ns: str | None
    after: int = 0
    limit: int = 1000


@dataclass(frozen=True)
class Lookup:
    """Which of the caller's sequences ``ns/names[i]`` exist with at least ``min_pages``
    complete pages, in one request (an engine asking for a prefix of block keys)."""

    ns: str
    names: tuple[str, ...]
    min_pages: int = 1


@dataclass(frozen=True)
class Delete:
    """Delete ``ns/seq``; with ``uid`` (not 0), only if that is still its uid."""

    ns: str
    seq: str
    uid: int = 0


@dataclass(frozen=True)
class Put:
    """Pages ``pages`` of layers ``layers`` (all KV heads).

    Source bytes are ``[len(layers), num_kv_heads, len(pages), block_bytes]``
    contiguous at ``offset`` in buffer ``buf``. ``cluster``/``order``/``importance``
    are per (layer, head, page) in the same order, or None.
    """

    uid: int
    layers: np.ndarray
    pages: np.ndarray
    buf: int
    offset: int
    cluster: np.ndarray | None
    order: np.ndarray | None
    importance: np.ndarray | None


@dataclass(frozen=True)
class Get:
    """Blocks ``blocks[i] = (layer, head, page)`` go to ``offset + dst[i]`` in ``buf``.

    Block i is of sequence ``seqs[i]`` where ``seqs`` is given, else of ``uid``.
    """

    uid: int
    buf: int
    offset: int
    blocks: np.ndarray
    dst: np.ndarray | None
    seqs: np.ndarray | None = None


@dataclass(frozen=True)
class Stats:
    pass


@dataclass(frozen=True)
class BlockLookup:
    """Which of ``keys`` the caller's block namespace ``ns`` holds."""

    ns: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class BlockPut:
    """Store block i of ``keys`` from ``offset + i * block_bytes`` (``offset + offsets[i]``
    where ``offsets`` is given) in buffer ``buf`` into the caller's block namespace ``ns``
    (made on the first put, with this block size). A block in ``regions`` equal regions
    (its K and V, say) has ``offsets[i * regions + r]`` for its region r; a namespace made
    by such a put keeps each part of a block within one region."""

    ns: str
    block_bytes: int
    keys: tuple[bytes, ...]
    buf: int
    offset: int
    offsets: np.ndarray | None = None
    regions: int = 1


@dataclass(frozen=True)
class BlockGet:
    """Copy the block of each of ``keys`` that ``ns`` holds to ``offset + i * block size``
    (``offset + offsets[i]`` where ``offsets`` is given; ``offsets[i * regions + r]`` for
    region r of a block in ``regions`` equal regions) in ``buf``."""

    ns: str
    keys: tuple[bytes, ...]
    buf: int
    offset: int
    offsets: np.ndarray | None = None
    regions: int = 1


@dataclass(frozen=True)
class BlockDelete:
    """Delete ``keys`` from ``ns``, or (``keys`` empty, ``all``) the whole namespace."""

    ns: str
    keys: tuple[bytes, ...]
    all: bool


BlockRequest = BlockLookup | BlockPut | BlockGet | BlockDelete
Request = Hello | Create | OpenSeq | ListSeqs | Delete | Put | Get | Stats | Lookup | BlockRequest


@dataclass(frozen=True)
class RegisterMemfd:
    """A session-socket register of a sealed memfd: ``size`` bytes of the one descriptor sent."""

    size: int


@dataclass(frozen=True)
class RegisterPool:
    """A session-socket register of an unsealed shared-memory file (memfd or tmpfs) the
    daemon maps under its SIGBUS guard: ``size`` bytes of the one descriptor sent."""

    size: int


@dataclass(frozen=True)
class RegisterCudaIpc:
    """A session-socket register of ``size`` bytes at ``offset`` in the CUDA allocation
    that ``handle`` (a ``cudaIpcMemHandle_t``) names, on device ``device``."""

    handle: bytes
    device: int
    offset: int
    size: int

    def __repr__(self) -> str:  # the handle is a capability: logs show only its length
        return f"RegisterCudaIpc(device={self.device}, offset={self.offset}, size={self.size})"


def parse_register(req: dict, num_fds: int) -> RegisterMemfd | RegisterPool | RegisterCudaIpc:
    """Check a ``register`` message of the session socket (see docs/protocol.md).

    Every field is checked here, before any limit is looked at or anything is opened.
    """
    kind = req.get("kind", BUFFER_KIND_MEMFD)
    if kind in (BUFFER_KIND_MEMFD, "shm", BUFFER_KIND_POOL):
        size = req.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_BUFFER_BYTES:
            raise ProtocolError(ErrorCode.BAD_FIELD, "field 'size' must be an integer in 1..2^44")
        if num_fds != 1:
            raise ProtocolError(ErrorCode.BUFFER, f"a register carries exactly one file descriptor, got {num_fds}")
        return RegisterPool(size) if kind == BUFFER_KIND_POOL else RegisterMemfd(size)
    if kind != BUFFER_KIND_CUDA_IPC:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"buffer kind {kind!r:.32} is not {BUFFER_KIND_MEMFD} (or shm), {BUFFER_KIND_POOL} or {BUFFER_KIND_CUDA_IPC}",
        )
    f = _Fields(req)
    handle = f._get("handle")
    if not isinstance(handle, bytes):
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'handle' must be the {CUDA_IPC_HANDLE_BYTES} bytes of a cudaIpcMemHandle_t (msgpack bin), "
            f"got {type(handle).__name__}",
        )
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'handle' must be exactly {CUDA_IPC_HANDLE_BYTES} bytes (a cudaIpcMemHandle_t), got {len(handle)}",
        )
    device = f.int("device", 0, MAX_CUDA_DEVICE)
    offset = f.int("offset", 0, MAX_BUFFER_BYTES)
    size = f.int("size", 1, MAX_BUFFER_BYTES)
    if offset + size > MAX_BUFFER_BYTES:
        raise ProtocolError(
            ErrorCode.OUT_OF_RANGE,
            f"'offset' + 'size' = {offset + size} is past 2^44 (offset {offset}, size {size})",
        )
    if num_fds:
        raise ProtocolError(ErrorCode.BUFFER, f"a {BUFFER_KIND_CUDA_IPC} register carries no file descriptor, got {num_fds}")
    return RegisterCudaIpc(handle, device, offset, size)

# ---------------------------------------------------------------- decoding


class _Fields:
    def __init__(self, header: dict) -> None:
        self.h = header

    def _get(self, name: str, required: bool = True) -> Any:
        if name not in self.h:
            if required:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} is missing")
            return None
        return self.h[name]

    def int(self, name: str, lo: int, hi: int, default: int | None = None) -> int:
        v = self._get(name, default is None)
        if v is None:
            return default  # type: ignore[return-value]
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"field {name!r} = {v} is outside {lo}..{hi}")
        return v

    def bool(self, name: str, default: bool) -> bool:
        v = self._get(name, False)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a boolean")
        return v

    def name(self, name: str, required: bool = True) -> str | None:
        v = self._get(name, required)
        if v is None:
            return None
        if not isinstance(v, str) or not _NAME_RE.match(v):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field {name!r} must be 1..{MAX_NAME_BYTES} printable ASCII characters without spaces",
            )
        return v

    def names(self, name: str, max_len: int) -> tuple[str, ...]:
        v = self._get(name)
        if not isinstance(v, list) or not v or len(v) > max_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a list of 1..{max_len} names")
        if not all(isinstance(x, str) and _NAME_RE.match(x) for x in v):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field {name!r} must hold names of 1..{MAX_NAME_BYTES} printable ASCII characters without spaces",
            )
        return tuple(v)

    def keys(self, name: str, required: bool = True) -> tuple[bytes, ...]:
        v = self._get(name, required)
        if v is None:
            return ()
        if not isinstance(v, list) or not 1 <= len(v) <= MAX_BLOCK_KEYS:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a list of 1..{MAX_BLOCK_KEYS} keys "
                                                     f"(split a longer one)")
        # set(map(type)) and min/max(map(len)) run in C: a genexpr costs ~1 us a key here.
        if set(map(type, v)) != {bytes} or min(map(len, v)) < 1 or max(map(len, v)) > MAX_BLOCK_KEY_BYTES:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must hold keys of 1..{MAX_BLOCK_KEY_BYTES} "
                                                     f"bytes (msgpack bin)")
        return tuple(v)

    def offsets(self, name: str, count: int, regions: int = 1, frame: np.ndarray | None = None) -> np.ndarray | None:
        """An optional list of ``regions`` offsets per key (``count`` keys), each in 0..2^44,
        in the header or as an array ``frame`` (int64), not both."""
        v = self._get(name, False)
        if frame is not None:
            if v is not None:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{name!r} is given twice: as a field and as an array frame")
            v = frame
        elif v is None:
            return None
        each = "one integer per key" if regions == 1 else f"{regions} integers (regions) per key"
        if not isinstance(v, (list, np.ndarray)) or len(v) != count * regions:
            got = f"{len(v)} values" if isinstance(v, (list, np.ndarray)) else type(v).__name__
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a list of {each} "
                                                     f"({count * regions}), got {got}")
        if isinstance(v, list) and v and set(map(type, v)) != {int}:  # msgpack gives ints as int, never bool
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must hold integers only")
        low, high = (min(v), max(v)) if isinstance(v, list) else (v.min(), v.max()) if len(v) else (0, 0)
        if low < 0 or high > MAX_BUFFER_BYTES:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"field {name!r} has values outside 0..2^44")
        return np.asarray(v, dtype=np.int64)

    def int_array(self, name: str, lo: int, hi: int, max_len: int) -> np.ndarray:
        v = self._get(name)
        if not isinstance(v, list) or not v or len(v) > max_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a list of 1..{max_len} integers")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must hold integers only")
        try:
            a = np.asarray(v, dtype=np.int64)
        except OverflowError:  # msgpack reads up to 2^64 - 1
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"field {name!r} has values outside {lo}..{hi}") from None
        if a.min() < lo or a.max() > hi:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"field {name!r} has values outside {lo}..{hi}")
        if len(np.unique(a)) != len(a):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} repeats a value")
        return a


def _arrays(header: dict, frames: list, allowed: dict[str, type], max_bytes: int) -> dict[str, np.ndarray]:
    names = header.get("frames", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ProtocolError(ErrorCode.BAD_FIELD, "field 'frames' must be a list of array names")
    if len(names) != len(frames):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header names {len(names)} array frames, message carries {len(frames)}")
    out: dict[str, np.ndarray] = {}
    for name, frame in zip(names, frames):
        if name not in allowed or name in out:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"array frame {name!r} is unknown or repeated here")
        dtype = np.dtype(allowed[name])
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        if len(buf) > max_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"array frame {name!r} is {len(buf)} bytes, limit {max_bytes}")
        if len(buf) % dtype.itemsize:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"array frame {name!r} is not a whole number of {dtype} items")
        out[name] = np.frombuffer(buf, dtype=dtype)
    return out


def clamp_importance(values: np.ndarray | None) -> np.ndarray | None:
    """``values`` within [0, :data:`MAX_IMPORTANCE`]; NaN or infinity is ``bad_field``."""
    if values is None:
        return None
    if not np.isfinite(values).all():
        raise ProtocolError(ErrorCode.BAD_FIELD, f"'importance' holds NaN or infinity; give finite values, which are "
                                                 f"kept within 0..{MAX_IMPORTANCE:.0f}")
    return np.clip(values, 0.0, MAX_IMPORTANCE).astype(np.float32, copy=False)


@dataclass(frozen=True)
class Envelope:
    """What every request carries besides its op: who sent it and until when it matters."""

    req_id: int
    session: bytes | None  # None only for hello
    deadline: float | None  # seconds since the epoch
    request: "Request"


def parse_request(frames: list, max_message_bytes: int, max_blocks: int) -> Envelope:
    """Decode and check one request.

    Raises ProtocolError; its ``args`` carry the request id when one was readable,
    so the error reply can name it.
    """
    if not frames:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "empty message")
    head = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header is {len(head)} bytes, limit {MAX_HEADER_BYTES}")
    total = sum(len(f.buffer if hasattr(f, "buffer") else f) for f in frames)
    if total > max_message_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message is {total} bytes, limit {max_message_bytes}")
    try:
        header = msgpack.unpackb(bytes(head), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header is not msgpack: {exc.__class__.__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "header must be a msgpack map")
    req_id = header.get("id")
    if not (isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id < 1 << 63):
        raise ProtocolError(ErrorCode.BAD_FIELD, "field 'id' must be an integer in 0..2^63-1")
    try:
        request = _parse_op(header, frames[1:], max_message_bytes, max_blocks)
        session = header.get("session")
        if isinstance(request, Hello) and session is None:
            return Envelope(req_id, None, None, request)
        if not (isinstance(session, bytes) and len(session) == SESSION_TOKEN_BYTES):
            raise ProtocolError(
                ErrorCode.SESSION,
                f"field 'session' must be the {SESSION_TOKEN_BYTES}-byte token of a session opened on the session socket",
            )
        deadline = header.get("deadline")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
            raise ProtocolError(ErrorCode.BAD_FIELD, "field 'deadline' must be a number (seconds since the epoch)")
        return Envelope(req_id, session, None if deadline is None else float(deadline), request)
    except ProtocolError as exc:
        exc.req_id = req_id  # type: ignore[attr-defined]
        raise
    except Exception as exc:  # a field this parser checks too little: still a refusal, with the id
        log.warning("request %d: unexpected %s while parsing", req_id, exc.__class__.__name__, exc_info=True)
        err = ProtocolError(ErrorCode.BAD_MESSAGE, f"request could not be parsed: {exc.__class__.__name__}: {exc}"[:500])
        err.req_id = req_id  # type: ignore[attr-defined]
        raise err from None


def _parse_op(header: dict, frames: list, max_bytes: int, max_blocks: int) -> Request:
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 == 1.0
        raise ProtocolError(ErrorCode.BAD_VERSION, f"protocol version {version!r} is not {PROTOCOL_VERSION}")
    if header.get("op") in ("register", "unregister"):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED,
            "buffers are registered on the session socket, as file descriptors (see docs/protocol.md)",
        )
    try:
        op = Op(header.get("op"))
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {header.get('op')!r:.64}") from None
    f = _Fields(header)
    if op in (Op.HELLO, Op.STATS):
        return Hello() if op is Op.HELLO else Stats()
    if op is Op.CREATE:
        try:
            geometry = Geometry.from_dict(header.get("geometry"))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"geometry: {exc}") from None
        return Create(f.name("ns"), f.name("seq"), geometry, f.bool("exist_ok", False))
    if op is Op.OPEN:
        return OpenSeq(f.name("ns"), f.name("seq"))
    if op is Op.DELETE:
        return Delete(f.name("ns"), f.name("seq"), f.int("uid", 0, 1 << 62, 0))
    if op is Op.LOOKUP:
        return Lookup(f.name("ns"), f.names("seqs", MAX_LOOKUP), f.int("min_pages", 0, MAX_PAGES, 1))
    if op is Op.LIST:
        return ListSeqs(f.name("ns", required=False), f.int("after", 0, 1 << 62, 0), f.int("limit", 1, MAX_LIST, MAX_LIST))
    if op is Op.PUT:
        layers = f.int_array("layers", 0, 1 << 20, MAX_LAYERS_PER_PUT)
        pages = f.int_array("pages", 0, MAX_PAGES - 1, max_blocks)
        arrays = _arrays(header, frames, PUT_ARRAYS, max_bytes)
        return Put(
            f.int("seq", 0, 1 << 62), layers, pages, f.int("buf", 0, 1 << 31), f.int("offset", 0, 1 << 44),
            arrays.get("cluster"), arrays.get("order"), clamp_importance(arrays.get("importance")),
        )
    if op is Op.GET:
        return _parse_get(f, header, frames, max_bytes, max_blocks)
    moves = op in (Op.BLOCK_PUT, Op.BLOCK_GET)
    return _parse_block_op(op, f, _arrays(header, frames, BLOCK_ARRAYS if moves else {}, max_bytes))


def _parse_block_op(op: Op, f: _Fields, arrays: dict[str, np.ndarray]) -> BlockRequest:
    if op is Op.BLOCK_LOOKUP:
        return BlockLookup(f.name("ns"), f.keys("keys"))
    if op is Op.BLOCK_PUT:
        ns, block_bytes, keys = f.name("ns"), f.int("block_bytes", 4, MAX_BLOCK_BYTES), f.keys("keys")
        regions = f.int("regions", 1, MAX_LAYERS, 1)
        return BlockPut(ns, block_bytes, keys, f.int("buf", 0, 1 << 31), f.int("offset", 0, 1 << 44),
                        f.offsets("offsets", len(keys), regions, arrays.get("offsets")), regions)
    if op is Op.BLOCK_GET:
        ns, keys = f.name("ns"), f.keys("keys")
        regions = f.int("regions", 1, MAX_LAYERS, 1)
        return BlockGet(ns, keys, f.int("buf", 0, 1 << 31), f.int("offset", 0, 1 << 44),
                        f.offsets("offsets", len(keys), regions, arrays.get("offsets")), regions)
    if op is Op.BLOCK_DELETE:
        keys, every = f.keys("keys", required=False), f.bool("all", False)
        if bool(keys) == every:
            raise ProtocolError(ErrorCode.BAD_FIELD, "a block_delete names 'keys' or says 'all': true, not both")
        return BlockDelete(f.name("ns"), keys, every)
    raise AssertionError(f"op {op} has no parser")


def _parse_get(f: _Fields, header: dict, frames: list, max_bytes: int, max_blocks: int) -> Get:
    arrays = _arrays(header, frames, GET_ARRAYS, max_bytes)
    if "blocks" not in arrays:
        raise ProtocolError(ErrorCode.BAD_FIELD, "a get needs a 'blocks' array frame (int32 [N, 3]: layer, head, page)")
    blocks = arrays["blocks"]
    if len(blocks) == 0 or len(blocks) % 3:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "'blocks' must hold N > 0 rows of (layer, head, page)")
    blocks = blocks.reshape(-1, 3)
    if len(blocks) > max_blocks:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(blocks)} blocks in one get, limit {max_blocks}")
    if blocks.min() < 0:
        raise ProtocolError(ErrorCode.OUT_OF_RANGE, "'blocks' holds a negative layer, head or page")
    dst = arrays.get("dst")
    if dst is not None:
        if len(dst) != len(blocks):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'dst' has {len(dst)} offsets for {len(blocks)} blocks")
        if len(dst) and dst.min() < 0:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, "'dst' holds a negative offset")
    seqs = arrays.get("seqs")
    if seqs is not None:
        if len(seqs) != len(blocks):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'seqs' has {len(seqs)} uids for {len(blocks)} blocks")
        if seqs.min() < 0:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, "'seqs' holds a negative uid")
    return Get(f.int("seq", 0, 1 << 62), f.int("buf", 0, 1 << 31), f.int("offset", 0, 1 << 44), blocks, dst, seqs)


def check_deadline(env: Envelope) -> None:
    """Refuse a request whose deadline passed before it could start (it does not run)."""
    if env.deadline is not None and time.time() > env.deadline:
        raise ProtocolError(
            ErrorCode.EXPIRED,
            f"the request's deadline passed {time.time() - env.deadline:.3f} s before it could start; it did not run",
        )
