"""Which kvstored ``connect()`` talks to, and a fast, clear answer when none is there.

``connect()`` with no argument takes the default daemon: ``$KVDRIVE_ADDRESS`` if set,
else the user's runtime-directory socket (where ``kvstored --ssd DIR --dram SIZE``
listens), else ``/run/kvdrive/kvstored.sock`` (the systemd unit's) when only that one
exists; see :mod:`kvdrive.protocol.address`. ``connect(None)`` is something else: a
private embedded daemon.

A ZeroMQ client connecting to an ipc:// path where nobody listens does not fail: it
retries in the background, and the first request waits out its timeout. So before
connecting, :func:`check_socket` looks at the path itself: no file there, a file that
is not a socket, or a socket nobody accepts on (a daemon that died without removing
it) are reported at once, in words that say how to start a daemon.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
import stat

from kvdrive.protocol.address import ADDRESS_ENV, default_address, default_addresses, describe_defaults, ipc_path
from kvdrive_client.errors import StoreUnavailableError

# How long a plain connect to the socket may take to tell a live daemon from a stale file.
PROBE_TIMEOUT_S = 1.0


class Default(enum.Enum):
    """The type of :data:`DEFAULT`."""

    DEFAULT = "the default kvstored"

    def __repr__(self) -> str:
        return "DEFAULT"


# ``connect()``'s address when none is given: the default daemon (``None`` means a private one).
DEFAULT = Default.DEFAULT


def resolve(address: str | Default) -> tuple[str, bool]:
    """The address to connect to, and whether it was chosen by default."""
    if address is DEFAULT:
        return default_address(), True
    if not isinstance(address, str) or not address:
        raise TypeError(f"address must be 'ipc://PATH' or 'tcp://HOST:PORT' (or None for a private daemon), "
                        f"got {address!r}")
    if not address.startswith(("ipc://", "tcp://")):
        raise ValueError(f"kvstored listens on ipc://PATH or tcp://HOST:PORT, not {address!r:.80}; "
                         f"connect() with no address finds the default daemon")
    return address, False


def check_socket(address: str, by_default: bool = False) -> None:
    """Raise :class:`StoreUnavailableError` at once when ``address`` is an ipc:// path no daemon serves."""
    path = ipc_path(address)
    if path is None:
        return
    looked = f" (with no address, connect() looked in order at: {describe_defaults()})" if by_default else ""
    # A daemon started without --listen binds the first default: the command needs no more.
    listen = "" if by_default and address == default_addresses()[0] and not os.environ.get(ADDRESS_ENV) else \
        f" --listen {address}"
    start = (f"start one with `kvstored --ssd DIR --dram SIZE{listen}`, or use connect(None) for a private daemon "
             f"in a temporary directory")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StoreUnavailableError(f"no kvstored answers at {address}: there is no socket at {path}{looked}; "
                                    f"{start}") from None
    except PermissionError:
        raise StoreUnavailableError(f"no kvstored answers at {address}: this user may not reach {path} (permission "
                                    f"denied on its directory); join the daemon's group (kvdrive for the systemd "
                                    f"unit){looked}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StoreUnavailableError(f"no kvstored answers at {address}: {path} is not a socket{looked}; {start}")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        raise StoreUnavailableError(f"no kvstored answers at {address}: nobody listens on the socket {path} (a daemon "
                                    f"that stopped without removing it){looked}; {start}") from None
    except PermissionError:
        raise StoreUnavailableError(f"no kvstored answers at {address}: this user may not connect to {path} "
                                    f"(permission denied); join the daemon's group (kvdrive for the systemd unit) "
                                    f"or start it with --socket-mode 0666") from None
    except (BlockingIOError, TimeoutError):
        pass  # a daemon whose backlog is full is alive: the ping that follows waits for it
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EINPROGRESS):
            raise StoreUnavailableError(f"no kvstored answers at {address}: connecting to {path} failed: "
                                        f"{exc.strerror or exc}{looked}") from None
    finally:
        probe.close()
