"""The daemon's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

# Shared with the clients: connect() with no address finds a daemon started without --listen.
from kvdrive.protocol.address import SESSION_SUFFIX, UNIX_PATH_MAX, default_runtime_dir
from kvstored.limits import SessionLimits

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'96G' -> bytes. Units K/M/G/T are powers of 1024; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"size {text!r} is not a number with an optional K/M/G/T unit (e.g. 512M, 96G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_host_port(text: str, option: str = "--metrics") -> tuple[str, int]:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); an IPv6 host goes in brackets: '[::1]:9464'."""
    host, sep, port = str(text).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{option} {text!r} is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9464)")
    return host, int(port)


class UnsafeDirectoryError(RuntimeError):
    """A socket directory another user could have made or can change."""


def check_private_dir(path: Path, create: bool = False) -> None:
    """Refuse a socket directory this process's user does not own or that others can write.

    Anyone may create a directory in /tmp; one that another user made there first
    (``/tmp/kvdrive-UID`` is the fallback runtime directory) would let that user put a
    fake daemon's socket in it. With ``create`` a missing directory is made owner-only.
    """
    if create:
        try:
            path.mkdir(parents=True, mode=0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"socket directory {path} is not a directory (a symbolic link?); refusing it")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"socket directory {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); another user "
            f"may have made it: remove it, or choose another directory"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(
            f"socket directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"make it writable by its owner only (chmod go-w)"
        )


class SyncPolicy:
    """When a put is acknowledged (see docs/durability.md)."""

    # fdatasync the data file, then commit LMDB with fsync, then reply.
    DURABLE = "durable"
    # Reply once the bytes are in the page cache and LMDB commits without fsync;
    # a power loss or kernel crash may lose acknowledged puts (a daemon crash does not).
    WRITE_BEHIND = "write-behind"
    ALL = (DURABLE, WRITE_BEHIND)


# The part of --index-max one uid may take by default (--index-max-per-uid): most of it, for a daemon
# with one user, while the rest stays for others.
INDEX_SHARE_PER_UID = 7 / 8

# SSD read engines (kvstored.io_engine): auto picks one and logs why.
ENGINES = ("auto", "aio", "posix", "kvikio")


@dataclass(frozen=True)
class DaemonConfig:
    ssd_dir: Path
    dram_bytes: int
    ssd_max_bytes: int = 1 << 40
    address: str = ""
    io_threads: int = 8
    get_workers: int = 4
    max_gap_bytes: int = 64 << 10
    max_io_bytes: int = 4 << 20
    sync: str = SyncPolicy.DURABLE
    # With --sync write-behind: page-cache writes not yet on the disk past which puts wait (writeback.py).
    write_behind_backlog_bytes: int = 512 << 20
    direct_io: bool = True
    max_message_bytes: int = 64 << 20
    max_blocks_per_request: int = 1 << 22
    # Cap on the in-memory block index (kvstored.index): puts and creates past it get 'full'.
    index_max_bytes: int = 4 << 30
    # What one owner's (uid's) sequences may take of it; 0: INDEX_SHARE_PER_UID of index_max_bytes.
    index_max_per_uid_bytes: int = 0
    lmdb_map_bytes: int = 64 << 30
    engine: str = "auto"
    # Stop when this process is no longer our parent (a private daemon outliving a crashed client).
    parent_pid: int = 0
    # A private daemon's directory (kvdrive_client.embedded), holding ssd_dir; at shutdown kvstored removes
    # what it made there (kvstored/ephemeral.py).
    ephemeral_dir: Path | None = None
    # The session socket (kvstored/sessions.py); default: beside an ipc socket, else in the runtime directory.
    session_socket: str = ""
    # Both sockets: owner and group may connect by default; what a client may touch is decided by its uid.
    socket_mode: int = 0o660
    session_limits: SessionLimits = field(default_factory=SessionLimits)
    # Client buffers all sessions together may map.
    max_mapped_bytes: int = 16 << 40
    # HOST:PORT of the Prometheus endpoint (kvstored/metrics.py); empty: none.
    metrics_address: str = ""
    # (namespace pattern, bytes): a namespace matching a pattern (fnmatch; the first one wins)
    # holds at most that many bytes; past it, its least recently used sequences are deleted.
    quotas: tuple[tuple[str, int], ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ssd_dir", Path(self.ssd_dir))
        if self.dram_bytes < 0:
            raise ValueError(f"--dram must be >= 0, got {self.dram_bytes}")
        if self.ssd_max_bytes < 1 << 20:
            raise ValueError(f"--ssd-max must be at least 1M, got {self.ssd_max_bytes}")
        if not 1 <= self.io_threads <= 256:
            raise ValueError(f"--io-threads must be in 1..256, got {self.io_threads}")
        if not 1 <= self.get_workers <= 64:
            raise ValueError(f"--get-workers must be in 1..64, got {self.get_workers}")
        if self.max_gap_bytes < 0:
            raise ValueError(f"--max-gap must be >= 0, got {self.max_gap_bytes}")
        if self.max_io_bytes < 4096:
            raise ValueError(f"--max-io must be >= 4K, got {self.max_io_bytes}")
        if self.index_max_bytes < 1 << 20:
            raise ValueError(f"--index-max must be at least 1M, got {self.index_max_bytes}")
        if not self.index_max_per_uid_bytes:
            object.__setattr__(self, "index_max_per_uid_bytes", int(self.index_max_bytes * INDEX_SHARE_PER_UID))
        if not 0 < self.index_max_per_uid_bytes < self.index_max_bytes:
            raise ValueError(f"--index-max-per-uid must be less than --index-max {format_size(self.index_max_bytes)}, "
                             f"so that other users keep room, got {format_size(self.index_max_per_uid_bytes)}")
        if self.sync not in SyncPolicy.ALL:
            raise ValueError(f"--sync must be one of {', '.join(SyncPolicy.ALL)}, got {self.sync!r}")
        if self.write_behind_backlog_bytes < 1 << 20:
            raise ValueError(f"--write-behind-backlog must be at least 1M, got {self.write_behind_backlog_bytes}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(f"--socket-mode must be an octal mode such as 0660, got {self.socket_mode:o}")
        if self.max_mapped_bytes < 1 << 20:
            raise ValueError(f"--max-mapped must be at least 1M, got {self.max_mapped_bytes}")
        if self.session_limits.buffers.max_bytes < 4096:
            raise ValueError(f"--max-client-buffers must be at least 4K, got {self.session_limits.buffers.max_bytes}")
        if self.ephemeral_dir is not None:
            object.__setattr__(self, "ephemeral_dir", Path(self.ephemeral_dir))
            inside = self.ssd_dir.is_relative_to(self.ephemeral_dir) and self.ssd_dir != self.ephemeral_dir
            if not self.ephemeral_dir.is_absolute() or not inside:
                raise ValueError(f"--ephemeral-dir {self.ephemeral_dir} must be an absolute path with --ssd "
                                 f"{self.ssd_dir} below it (kvstored makes --ssd there and removes it when it stops)")
        if self.metrics_address:
            parse_host_port(self.metrics_address)
        if self.address and not (self.address.startswith("ipc://") or self.address.startswith("tcp://127.")):
            raise ValueError(
                f"--listen {self.address!r}: use ipc://PATH or tcp://127.0.0.1:PORT (the daemon serves this host only)"
            )
        self._check_socket_paths()

    def _check_socket_paths(self) -> None:
        """Both Unix sockets' paths fit sockaddr_un: said before the store opens, in words, rather
        than as the socket's own error once it has."""
        paths = [("--session-socket" if self.session_socket else "the session socket", self.session_socket_path)]
        if self.bind_address.startswith("ipc://"):
            paths.insert(0, ("--listen", Path(self.bind_address[len("ipc://"):])))
        for what, path in paths:
            size = len(os.fsencode(path))
            if size > UNIX_PATH_MAX:
                hint = "" if self.session_socket or what == "--listen" else (
                    f" (kept beside --listen's, with {SESSION_SUFFIX!r} added: choose a shorter --listen, "
                    "or --session-socket)")
                raise ValueError(f"{what} {path} is {size} bytes long, and a Unix socket's path may be at most "
                                 f"{UNIX_PATH_MAX}{hint}")

    @property
    def metrics_endpoint(self) -> tuple[str, int] | None:
        return parse_host_port(self.metrics_address) if self.metrics_address else None

    @property
    def session_socket_path(self) -> Path:
        if self.session_socket:
            return Path(self.session_socket)
        address = self.bind_address
        if address.startswith("ipc://"):
            return Path(address[len("ipc://"):] + SESSION_SUFFIX)
        return default_runtime_dir() / "kvstored.session"

    @property
    def bind_address(self) -> str:
        if self.address:
            return self.address
        return f"ipc://{default_runtime_dir() / 'kvstored.sock'}"
