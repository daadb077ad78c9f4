"""Where kvstored listens when nobody says, and where a client looks for it.

The daemon and its clients must agree on this without being told, so it lives here,
beside the wire protocol, and imports neither ZeroMQ nor torch.

``kvstored`` with no ``--listen`` binds ``ipc://RUNTIME/kvstored.sock``, RUNTIME being
:func:`default_runtime_dir`: ``$RUNTIME_DIRECTORY`` (set by systemd for a unit with
``RuntimeDirectory=``), else ``$XDG_RUNTIME_DIR``, else ``/tmp/kvdrive-UID``.

A client given no address (``kvdrive_client.connect()``, ``kvstore-inspect
--address``) takes the first of :func:`default_addresses`:

1. ``$KVDRIVE_ADDRESS``, when set (any address ``connect`` takes), and nothing else;
2. the user's own socket, ``ipc://RUNTIME/kvstored.sock``, where a plain
   ``kvstored --ssd DIR --dram SIZE`` listens;
3. ``ipc:///run/kvdrive/kvstored.sock``, where the systemd unit's daemon listens.

2 is taken when its socket exists, else 3 when its socket does; when neither
exists the answer is 2 (and connecting fails at once, naming both).
"""

from __future__ import annotations

import os
from pathlib import Path

ADDRESS_ENV = "KVDRIVE_ADDRESS"
SOCKET_NAME = "kvstored.sock"
# Beside the --listen socket (its path with this added), unless --session-socket says where.
SESSION_SUFFIX = ".session"
# The longest path a Unix socket binds to (sockaddr_un's 108 bytes, less the terminating NUL).
UNIX_PATH_MAX = 107
# systemd/kvstored.service: RuntimeDirectory=kvdrive, --listen ipc:///run/kvdrive/kvstored.sock
SYSTEM_SOCKET = Path("/run/kvdrive") / SOCKET_NAME


def default_runtime_dir() -> Path:
    """The directory a daemon started without ``--listen`` puts its sockets in."""
    base = os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvdrive-{os.getuid()}"
    # systemd lists several runtime directories separated by ':'; the first is the unit's own.
    return Path(base.split(":")[0])


def ipc_path(address: str) -> Path | None:
    """The socket file of an ``ipc://`` address (None for tcp:// and abstract ``ipc://@name`` ones)."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):]
    return None if path.startswith("@") else Path(path)


def default_addresses() -> list[str]:
    """Where a client given no address looks for kvstored, in order (see the module docstring)."""
    env = os.environ.get(ADDRESS_ENV)
    if env:
        return [env]
    own = f"ipc://{default_runtime_dir() / SOCKET_NAME}"
    system = f"ipc://{SYSTEM_SOCKET}"
    return [own] if own == system else [own, system]


def default_address() -> str:
    """The first of :func:`default_addresses` whose socket exists (a tcp:// one always counts), else the first."""
    candidates = default_addresses()
    for address in candidates:
        path = ipc_path(address)
        if path is None or path.exists():
            return address
    return candidates[0]


def describe_defaults() -> str:
    """Where :func:`default_address` looked, in words, for error messages."""
    env = os.environ.get(ADDRESS_ENV)
    if env:
        return f"${ADDRESS_ENV}={env}"
    return ", ".join([f"${ADDRESS_ENV} (unset)", *default_addresses()])
