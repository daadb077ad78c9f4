"""``kvstored``: the KVDrive storage daemon."""

from __future__ import annotations

import argparse
import logging
import sys

from kvstored.buffers import BufferLimits
from kvstored.config import ENGINES, DaemonConfig, SyncPolicy, default_runtime_dir, parse_size
from kvstored.sessions import SessionLimits

log = logging.getLogger("kvstored")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstored",
        description="KVDrive storage daemon: holds every sequence's KV blocks in a DRAM tier and an SSD tier "
        "and serves sparse block reads to clients over ZeroMQ.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ssd", required=True, metavar="DIR", help="directory of the SSD tier (data file, LMDB metadata)")
    p.add_argument("--dram", required=True, metavar="SIZE", help="DRAM tier size, e.g. 512M or 96G (K/M/G/T = powers of 1024)")
    p.add_argument("--ssd-max", default="1T", metavar="SIZE", help="cap on the SSD tier; puts past it get a 'full' error")
    p.add_argument("--index-max", default="4G", metavar="SIZE",
                   help="cap on the in-memory block index (32 bytes per (layer, head, page) of each sequence's page "
                        "window); puts and creates past it get a 'full' error")
    p.add_argument(
        "--listen", default="", metavar="ADDR",
        help=f"ipc://PATH or tcp://127.0.0.1:PORT (default ipc://{default_runtime_dir()}/kvstored.sock)",
    )
    p.add_argument("--session-socket", default="", metavar="PATH",
                   help="the session socket clients open sessions and register buffers on (default: the ipc socket's "
                        "path + '.session', or kvstored.session in the runtime directory)")
    p.add_argument("--socket-mode", default="0660", metavar="MODE",
                   help="permissions of both sockets (octal): who may connect; what a client may touch is decided "
                        "by its uid, which the kernel reports")
    p.add_argument("--max-client-buffers", default="256G", metavar="SIZE",
                   help="client buffer bytes one session may register")
    p.add_argument("--max-mapped", default="16T", metavar="SIZE",
                   help="client buffer bytes all sessions together may register (the daemon maps them)")
    p.add_argument("--io-threads", type=int, default=8, help="threads issuing SSD reads (posix and kvikio engines)")
    p.add_argument("--get-workers", type=int, default=4,
                   help="gets that read the SSD served at once (small DRAM-only gets are served on the main thread)")
    p.add_argument("--max-gap", default="64K", metavar="SIZE", help="read through holes up to this size when coalescing")
    p.add_argument("--max-io", default="4M", metavar="SIZE", help="largest single read")
    p.add_argument(
        "--sync", choices=SyncPolicy.ALL, default=SyncPolicy.DURABLE,
        help="durable: a put is acknowledged after fdatasync and an fsynced LMDB commit; "
        "write-behind: acknowledged before, flushed within a second (a power loss may lose acknowledged puts)",
    )
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="SSD read engine: auto takes kvikio where cuFile reports GPUDirect Storage active, else Linux AIO on an "
                        "O_DIRECT file, else preadv on --io-threads threads")
    p.add_argument("--no-direct", action="store_true", help="buffered I/O instead of O_DIRECT (reads may hit the page cache)")
    p.add_argument("--parent-pid", type=int, default=0, metavar="PID",
                   help="shut down when process PID is no longer this daemon's parent (embedded daemons use it)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(
        ssd_dir=args.ssd,
        dram_bytes=parse_size(args.dram),
        ssd_max_bytes=parse_size(args.ssd_max),
        index_max_bytes=parse_size(args.index_max),
        address=args.listen,
        io_threads=args.io_threads,
        get_workers=args.get_workers,
        max_gap_bytes=parse_size(args.max_gap),
        max_io_bytes=parse_size(args.max_io),
        sync=args.sync,
        engine=args.engine,
        direct_io=not args.no_direct,
        parent_pid=args.parent_pid,
        session_socket=args.session_socket,
        socket_mode=_octal(args.socket_mode),
        session_limits=SessionLimits(buffers=BufferLimits(max_bytes=parse_size(args.max_client_buffers))),
        max_mapped_bytes=parse_size(args.max_mapped),
    )


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise ValueError(f"--socket-mode {text!r} is not an octal mode such as 0660") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"kvstored: {exc}", file=sys.stderr)
        return 2
    from kvstored.server import Server, install_signal_handlers  # noqa: PLC0415 - keep --help fast

    try:
        server = Server(cfg)
    except Exception as exc:  # start-up failures are reported plainly, not as a traceback
        log.error("cannot start: %s", startup_reason(exc))
        log.debug("cannot start", exc_info=True)
        return 1
    try:
        server.bind()
    except Exception as exc:  # a socket directory refused, another daemon on the socket, ...
        log.error("cannot start: %s", startup_reason(exc))
        log.debug("cannot start", exc_info=True)
        server.store.close()
        return 1
    install_signal_handlers(server)
    server.serve_forever()
    return 0


def startup_reason(exc: BaseException) -> str:
    """One sentence for why the daemon could not start."""
    from kvstored.files import StoreOpenError  # noqa: PLC0415 - keep --help fast

    if isinstance(exc, StoreOpenError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    text = str(exc)
    if type(exc).__name__ == "ZMQError":
        return f"cannot listen: {text}"
    if isinstance(exc, RuntimeError) and text:
        return text
    return f"unexpected {type(exc).__name__} ({text or 'no message'}); --log-level DEBUG shows where"


if __name__ == "__main__":
    sys.exit(main())
