"""What kind of file a descriptor is, as both sides of a pool registration check it: kvstored
maps a client's unsealed file only if it is shared memory (tmpfs: a memfd or a file in
/dev/shm), and a client offers only such files (docs/protocol.md, "Pool buffers")."""

from __future__ import annotations

import ctypes
import os

# statfs(2) f_type of tmpfs, which memfds (shmem) report too.
TMPFS_MAGIC = 0x01021994
_libc = ctypes.CDLL(None, use_errno=True)


def fs_type(fd: int) -> int:
    """``fstatfs(fd).f_type``; OSError where it fails."""
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type leads
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
