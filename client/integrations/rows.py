"""Keys, rows and block parts as a :class:`~kvdrive_client.integrations.blocks.BlockStore`
moves them: an engine key as kvstored's (:func:`key_bytes`), the compiled movers of its
staging copies (:mod:`kvdrive.protocol.copy`, loaded on first use), rows of one array
(:class:`Rows`) or spans of one array (:class:`Spans`), and a block given as parts."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvdrive.protocol import MAX_BLOCK_KEY_BYTES

log = logging.getLogger(__name__)


def key_bytes(key: bytes | str | int) -> bytes:
    """The kvstored block key of an engine key (:func:`keys_bytes` of one)."""
    return keys_bytes((key,))[0]


# Engine keys hashed lately, by their text: SGLang converts each page's key once for
# ``batch_exists`` and again for the ``batch_get_v1`` that follows. The 128 keys of a call
# found here cost about 15 us against 68 us hashed (a load of 64 KiB pages, inside a
# 1.4 ms call). At most HASHED_KEPT keys, about 230 bytes each (a 64-character string and
# its 33-byte key): about 7 MiB.
HASHED_KEPT = 1 << 15


class _Hashed:
    """Two generations of text -> key; when the young one holds half of HASHED_KEPT, it
    becomes the old one and the old one is dropped. Safe without a lock: a key is a pure
    function of its text, so a race only loses an entry."""

    def __init__(self) -> None:
        self.young: dict[str, bytes] = {}
        self.old: dict[str, bytes] = {}

    def find(self, keys: list) -> list[bytes] | None:
        """The keys of ``keys`` (strings) where every one is held, else None."""
        young = self.young
        try:
            got = list(map(young.get, keys))
        except TypeError:  # an unhashable key (a bytearray): not one of these
            return None
        if None not in got:
            return got
        old = self.old
        for i in [i for i, k in enumerate(got) if k is None]:
            key = old.get(keys[i])
            if key is None:
                return None
            got[i] = key
            self.add(keys[i], key)  # kept young, within the bound
        return got

    def add(self, text: str, key: bytes) -> None:
        if len(self.young) >= HASHED_KEPT // 2:
            self.old, self.young = self.young, {}
        self.young[text] = key


_HASHED = _Hashed()


def keys_bytes(keys: Iterable) -> list[bytes]:
    """The kvstored block key of each engine key: bytes as they are, a string as UTF-8, up to
    48 bytes (MAX_BLOCK_KEY_BYTES); anything longer or of another type by the SHA-256 of its
    bytes or text (a string's kept a while: :data:`HASHED_KEPT`). One loop for a call's
    keys, exact strings and bytes first: an SGLang call's 128 page hashes (64 hex
    characters each, so hashed) in 64 us, against 87 us as a function call each."""
    keys = keys if isinstance(keys, list) else list(keys)
    if keys and type(keys[0]) is str and (got := _HASHED.find(keys)) is not None:
        return got
    out: list[bytes] = []
    append, sha256, most, kept = out.append, hashlib.sha256, MAX_BLOCK_KEY_BYTES, _HASHED.add
    for key in keys:
        kind = type(key)
        if kind is str:
            raw = key.encode("utf-8", "surrogatepass")
            if len(raw) > most:
                append(k := b"h" + sha256(raw).digest())
                kept(key, k)
                continue
        elif kind is bytes:
            raw = key
        elif isinstance(key, (bytes, bytearray, memoryview)):
            raw = bytes(key)
        elif isinstance(key, str):
            raw = key.encode("utf-8", "surrogatepass")
        else:
            raw = b"\x00" + str(key).encode()  # apart from every bytes and string key
        append(raw if 0 < len(raw) <= most else b"h" + sha256(raw).digest())
    return out


_movers_module: list = []  # kvdrive.protocol.copy once imported, or None where it cannot be


def _movers():
    """:mod:`kvdrive.protocol.copy`, imported (with numba) on first use: by :meth:`BlockStore.open_early`'s
    thread, or else by the first load, so that a store used for lookups or stores alone never
    loads it; None, logged once, where numba cannot load (loads then copy with numpy)."""
    if not _movers_module:
        try:
            from kvdrive.protocol import copy as movers  # noqa: PLC0415
        except Exception as exc:  # noqa: BLE001 - a broken numba must not fail the engine's loads
            log.warning("KVDrive loads copy blocks out with numpy, without streaming stores: %s", exc)
            movers = None
        _movers_module.append(movers)
    return _movers_module[0]


def _copy_out():
    """:func:`kvdrive.protocol.copy.copy_out`, or None (:func:`_movers`)."""
    movers = _movers()
    return None if movers is None else movers.copy_out


class Rows:
    """Load targets that are rows of one array (an engine's CPU tier, a block a row): key i's
    block goes to row ``rows[i]``, the blocks of a get copied out of staging by one compiled
    call (:func:`kvdrive.protocol.copy.scatter_out`) instead of a Python step per block."""

    def __init__(self, array: np.ndarray, rows: Iterable[int], block_bytes: int) -> None:
        if array.dtype != np.uint8 or array.ndim != 2 or array.shape[1] != block_bytes or not (
                array.flags.c_contiguous and array.flags.writeable):
            raise ValueError(f"rows of a writable, contiguous uint8 array of {block_bytes}-byte rows, not "
                             f"{array.dtype} {array.shape}")
        self.rows = np.fromiter(rows, np.int64)
        if len(self.rows) and (self.rows.min() < 0 or self.rows.max() >= array.shape[0]):
            raise ValueError(f"rows outside the array's {array.shape[0]}")
        self.array, self.flat, self.block_bytes = array, array.reshape(-1), block_bytes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.array[self.rows[i]]

    def copy_in(self, staging: np.ndarray, at: int, js: list[int], batch: list[int]) -> None:
        """Blocks ``js`` of the slot at ``at`` into the rows of keys ``batch[j]``."""
        movers = _movers()
        if movers is None:
            for j in js:
                self[batch[j]][:] = staging[at + j * self.block_bytes: at + (j + 1) * self.block_bytes]
            return
        picks = np.asarray(js, np.int64)
        movers.scatter_out(self.flat, self.rows[np.asarray(batch, np.int64)[picks]] * self.block_bytes, staging,
                           at + picks * self.block_bytes, self.block_bytes)


class Spans:
    """Blocks that each lie in ``regions`` equal spans of one array (an SGLang page's K and V
    in its host pool): span r of block i at ``offsets[i, r]`` of ``array`` (1-D uint8).
    A request's blocks move between a staging slot and the array by one compiled call
    (:func:`kvdrive.protocol.copy.gather_in` / ``scatter_out``), and kvstored moves them in
    place where the array is shared (:meth:`BlockStore.share`)."""

    def __init__(self, array: np.ndarray, offsets: np.ndarray, span: int) -> None:
        self.offsets = np.asarray(offsets, np.int64)
        if array.dtype != np.uint8 or array.ndim != 1 or not (array.flags.c_contiguous and array.flags.writeable):
            raise ValueError("spans of a writable, contiguous 1-D uint8 array")
        if self.offsets.ndim != 2 or span <= 0:
            raise ValueError(f"offsets of blocks x regions, spans of a positive size, not {self.offsets.shape}, {span}")
        if self.offsets.size and (self.offsets.min() < 0 or self.offsets.max() + span > array.nbytes):
            raise ValueError(f"spans outside the array's {array.nbytes} bytes")
        self.array, self.span = array, span
        self.regions = self.offsets.shape[1]

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> list[np.ndarray]:
        return [self.array[o: o + self.span] for o in self.offsets[i].tolist()]

    def _in_slot(self, at: int, js: np.ndarray) -> np.ndarray:
        """Where the spans of blocks ``js`` of the slot at ``at`` lie in it, in order."""
        r = np.arange(self.regions, dtype=np.int64) * self.span
        return (at + js[:, None] * (self.regions * self.span) + r).reshape(-1)

    def copy_in(self, staging: np.ndarray, at: int, js: list[int], batch: list[int]) -> None:
        """Blocks ``js`` of the slot at ``at`` into the spans of keys ``batch[j]``."""
        picks = np.asarray(js, np.int64)
        dst = self.offsets[np.asarray(batch, np.int64)[picks]].reshape(-1)
        src = self._in_slot(at, picks)
        if (movers := _movers()) is None:
            for d, f in zip(dst.tolist(), src.tolist()):
                self.array[d: d + self.span] = staging[f: f + self.span]
            return
        movers.scatter_out(self.array, dst, staging, src, self.span)

    def copy_to(self, staging: np.ndarray, to: int, batch: list[int]) -> None:
        """The blocks of keys ``batch`` into the slot from ``to``, one after another."""
        src = self.offsets[np.asarray(batch, np.int64)].reshape(-1)
        dst = self._in_slot(to, np.arange(len(batch), dtype=np.int64))
        if (movers := _movers()) is None:
            for d, f in zip(dst.tolist(), src.tolist()):
                staging[d: d + self.span] = self.array[f: f + self.span]
            return
        movers.gather_in(staging, dst, self.array, src, self.span)


def _parts(block: Any, block_bytes: int, what: str) -> list[np.ndarray]:
    """A block as uint8 arrays over its memory: one buffer, or a list or tuple of buffers
    (the parts of a block that lies in several places, such as its K and V), in order."""
    parts = [np.frombuffer(b, dtype=np.uint8) for b in (block if isinstance(block, (list, tuple)) else [block])]
    total = sum(p.nbytes for p in parts)
    if total != block_bytes:
        raise ValueError(f"a {what} of {total} bytes; this store's blocks are {block_bytes}")
    return parts
