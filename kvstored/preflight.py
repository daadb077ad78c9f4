"""Checks before the store opens: mistakes a person can fix, told in one line, at once.

Opening the store pre-faults the whole DRAM tier, which takes minutes for a large
``--dram``; a daemon that would fail anyway must not make its operator wait for that.
Each check raises :class:`PreflightError` whose message names the option, the value
and what to change.

- :func:`check_ssd_dir`: ``--ssd`` can be created, listed and written.
- :func:`check_socket_dirs`: the sockets' directories are this user's own.
- :func:`check_listen`: no other daemon (or program) holds the ``--listen`` address.
- :func:`check_dram`: ``--dram`` fits in this host's memory (and this cgroup's limit).
- :func:`check_index_max`: ``--index-max`` fits in this host's memory beside ``--dram``.
- :func:`claim_ephemeral_dir`: ``--ephemeral-dir`` is safe to remove things from
  (kvstored/ephemeral.py); it and the directories kvstored makes in it are created first.
- :func:`warn_exposed_metrics`: a WARNING where ``--metrics`` serves other hosts.

The metrics port is checked by binding it for real (kvstored/metrics.py), also before
the store opens.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import secrets
import socket
from pathlib import Path

from kvstored.config import DaemonConfig, UnsafeDirectoryError, check_private_dir
from kvstored.ephemeral import EphemeralDir, EphemeralDirError, claim

log = logging.getLogger(__name__)

# How long a daemon on the socket gets to answer the probe.
PROBE_MS = 300


class PreflightError(RuntimeError):
    """The daemon cannot start as configured; the message says which option to change."""


def run_checks(cfg: DaemonConfig, dram_text: str, made: list[Path]) -> EphemeralDir | None:
    """Every check; the ``--ephemeral-dir`` claimed (the caller removes it after the daemon stops).
    The directories made for ``--ssd`` are appended to ``made``, outermost first, and removed
    again (those still empty) when a check refuses; a caller whose start fails later does the same
    with :func:`remove_empty`."""
    ephemeral = claim_ephemeral_dir(cfg)
    try:
        made.extend(check_ssd_dir(cfg.ssd_dir))
        check_socket_dirs(cfg)
        check_listen(cfg.bind_address)
        check_dram(cfg.dram_bytes, dram_text)
        check_index_max(cfg.index_max_bytes, cfg.dram_bytes)
    except PreflightError:
        remove_empty(made)
        if ephemeral is not None:
            ephemeral.remove()
        raise
    warn_exposed_metrics(cfg.metrics_endpoint)
    return ephemeral


# ---------------------------------------------------------------- --ephemeral-dir


def claim_ephemeral_dir(cfg: DaemonConfig) -> EphemeralDir | None:
    """Refuse an ``--ephemeral-dir`` that is unsafe to remove things from, then create it and, inside
    it, ``--ssd`` and the sockets' directories, so that kvstored knows what it made."""
    if cfg.ephemeral_dir is None:
        return None
    inside = [cfg.ssd_dir, cfg.session_socket_path.parent]
    if cfg.bind_address.startswith("ipc://"):
        inside.append(Path(cfg.bind_address[len("ipc://"):]).parent)
    try:
        return claim(cfg.ephemeral_dir, [p for p in inside if p.is_relative_to(cfg.ephemeral_dir)])
    except EphemeralDirError as exc:
        raise PreflightError(str(exc)) from None


# ---------------------------------------------------------------- --ssd


def remove_empty(made: list[Path]) -> None:
    """Remove the directories of ``made`` (outermost first) that are still empty, innermost first."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            return  # not empty (a store was made there), or gone: leave it and what holds it


def check_ssd_dir(path: Path) -> list[Path]:
    """``path`` exists (or is made, owner-only) and this user can list it and write in it; the
    directories made for it, outermost first."""
    made = [p for p in (*reversed(path.absolute().parents), path.absolute()) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise PreflightError(f"--ssd {path}: cannot create the directory ({_reason(exc)}); "
                             "choose a directory kvstored may create, read and write") from None
    if not path.is_dir():
        raise PreflightError(f"--ssd {path}: not a directory; choose a directory kvstored may create, read and write")
    # Tried, not asked (os.access): root passes every permission check, yet not a read-only
    # mount. An empty file only: a full disk is no reason to refuse (the store starts on one
    # and refuses writes until deletes free space).
    probe = path / f".kvstored-probe-{secrets.token_hex(4)}"
    try:
        os.listdir(path)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return made
        remove_empty(made)
        raise PreflightError(f"--ssd {path}: cannot read and write the directory ({_reason(exc)}); "
                             "fix its owner or permissions, or choose another --ssd") from None
    return made


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


# ---------------------------------------------------------------- --listen


def check_socket_dirs(cfg: DaemonConfig) -> None:
    """The directories of both sockets exist (made owner-only) and no other user can change them."""
    dirs = [("--session-socket", cfg.session_socket_path.parent)]
    if cfg.bind_address.startswith("ipc://"):
        dirs.insert(0, ("--listen", Path(cfg.bind_address[len("ipc://"):]).parent))
    for option, path in dirs:
        try:
            check_private_dir(path, create=True)
        except UnsafeDirectoryError as exc:
            raise PreflightError(f"{option}: {exc}") from None
        except OSError as exc:
            raise PreflightError(f"{option}: cannot create the socket directory {path} ({_reason(exc)}); "
                                 f"choose another {option}") from None


def check_listen(address: str) -> None:
    """Refuse an address another daemon serves (a stale ipc socket file is left to :meth:`Server.bind`)."""
    if address.startswith("ipc://"):
        path = Path(address[len("ipc://"):])
        if path.exists() and daemon_answers(address):
            raise PreflightError(f"another kvstored is serving {address}; stop it or choose another --listen")
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if port.isdigit() and _port_taken(host, int(port)):
            if daemon_answers(address):
                raise PreflightError(f"another kvstored is serving {address}; stop it or choose another --listen")
            raise PreflightError(f"{address} is in use by another program; choose another --listen port")


def daemon_answers(address: str, timeout_ms: int = PROBE_MS) -> bool:
    """Whether a ZeroMQ peer at ``address`` answers a one-byte probe (any reply will do:
    a kvstored answers garbage with an error reply)."""
    import zmq  # noqa: PLC0415 - only a start-up needs it, not --help

    ctx = zmq.Context()
    probe = ctx.socket(zmq.DEALER)
    try:
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(address)
        probe.send(b"\x80")
        return bool(probe.poll(timeout_ms, zmq.POLLIN))
    finally:
        probe.close()
        ctx.term()


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


# ---------------------------------------------------------------- --metrics


def warn_exposed_metrics(endpoint: tuple[str, int] | None) -> None:
    """Log a WARNING where the metrics endpoint answers other hosts (any address but loopback)."""
    if endpoint is None:
        return
    host, port = endpoint
    exposed = _reachable_addresses(host)
    if exposed:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.warning("--metrics %s serves the metrics to other hosts (%s); to keep them on this host, give a "
                    "loopback address: --metrics 127.0.0.1:%d (or [::1]:%d)", where, ", ".join(exposed), port, port)


def _reachable_addresses(host: str) -> list[str]:
    """The addresses of ``host`` other hosts can reach ("every address" for 0.0.0.0 and ::)."""
    try:
        addresses = [ipaddress.ip_address(host.split("%")[0])]
    except ValueError:  # a name: what it resolves to
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return []  # the bind reports a name that does not resolve
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    out = []
    for a in addresses:
        if a.is_unspecified:
            out.append(f"{a} is every address of this host")
        elif not a.is_loopback and not (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback):
            out.append(f"{a} is not a loopback address")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- --dram

GIB = 1 << 30


def check_dram(nbytes: int, text: str) -> None:
    """Refuse a DRAM tier larger than the memory this process could have."""
    if not nbytes:
        return
    total, available = meminfo()
    limit = cgroup_memory_limit()
    if limit is not None and nbytes > limit and limit < total:
        raise PreflightError(f"--dram {text} is more than the {limit / GIB:.1f} GiB this service's cgroup may use "
                             "(memory.max); choose a smaller --dram or raise the limit (MemoryMax=)")
    if total and nbytes > total:
        raise PreflightError(f"--dram {text} is more than this host's {total / GIB:.1f} GiB of memory "
                             f"({available / GIB:.1f} GiB available); choose a smaller --dram")
    if total and nbytes > available:
        # Pre-faulting past what is available ends in swap or the OOM killer, not in an error.
        raise PreflightError(f"--dram {text} is more than the {available / GIB:.1f} GiB of memory this host has "
                             f"available ({total / GIB:.1f} GiB in all); choose a smaller --dram or free memory")


def meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; (0, 0) where the file cannot be read (no check then)."""
    fields: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024  # the kernel writes kB, meaning KiB
    except OSError as exc:
        log.warning("cannot read %s (%s); --dram is not checked against the host's memory", path, exc)
        return 0, 0
    total = fields.get("MemTotal", 0)
    return total, fields.get("MemAvailable", total)


def cgroup_memory_limit() -> int | None:
    """This process's cgroup v2 ``memory.max`` in bytes, or None (no limit, or no cgroup v2)."""
    try:
        with open("/proc/self/cgroup") as f:
            line = next((l for l in f if l.startswith("0::")), None)
        if line is None:
            return None
        text = (Path("/sys/fs/cgroup") / line[3:].strip().lstrip("/") / "memory.max").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# ---------------------------------------------------------------- --index-max


def check_index_max(nbytes: int, dram_bytes: int) -> None:
    """Refuse a block index cap this host could never back beside the DRAM tier; warn of one
    past this cgroup's limit or the memory available now.

    The index is the daemon's own memory beside the pre-faulted DRAM tier: a cap past the
    host's memory less ``--dram`` is reached, if ever, by swapping or the OOM killer, never
    by the 'full' replies it promises, so it is refused. The index grows only as sequences
    are stored, so memory that is not available now (or a cgroup limit, which can be
    raised while the daemon runs) is a risk to be told of, not a reason to refuse.
    """
    total, available = meminfo()
    text = f"--index-max {nbytes / GIB:.1f} GiB"
    if total and nbytes > total - dram_bytes:
        raise PreflightError(f"{text} is more than this host's {total / GIB:.1f} GiB of memory less --dram "
                             f"{dram_bytes / GIB:.1f} GiB; choose a smaller --index-max")
    limit = cgroup_memory_limit()
    if limit is not None and limit < total and nbytes > limit - dram_bytes:
        log.warning("%s is more than this service's cgroup memory.max %.1f GiB less --dram %.1f GiB: a full index "
                    "would end in the OOM killer; choose a smaller --index-max or raise the limit (MemoryMax=)",
                    text, limit / GIB, dram_bytes / GIB)
    elif total and nbytes > available - dram_bytes:
        log.warning("%s is more than the %.1f GiB of memory this host has available less --dram %.1f GiB: the "
                    "index may swap before it is full", text, available / GIB, dram_bytes / GIB)
