"""``kvstored``: the KVDrive storage daemon.

Start-up runs in the order that lets a mistake cost its operator one line and no
wait: the options (the command line over ``--config FILE``), the checks of
kvstored/preflight.py (the ephemeral directory, the SSD directory, the socket, the
DRAM size), the metrics port, and only then the store, whose DRAM tier is pre-faulted
(minutes for a large ``--dram``). Nothing heavy is imported before the options are
read: ``--help`` is fast. With ``--ephemeral-dir``, what kvstored made there is removed
once it has stopped (kvstored/ephemeral.py).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvdrive.protocol.release import add_version_option
from kvstored.config import ENGINES, DaemonConfig, SyncPolicy, default_runtime_dir, parse_size
from kvstored.limits import BufferLimits, SessionLimits
from kvstored.options import ConfigFileError, add_connection_options, connection_limits, load_config_file

if TYPE_CHECKING:
    from kvstored.metrics import Metrics

log = logging.getLogger("kvstored")

# Exit codes: an option or config file kvstored cannot use; a host that cannot run it as configured.
EXIT_USAGE = 2
EXIT_CANNOT_START = 1


def build_parser() -> argparse.ArgumentParser:
    """Every option's help states its default once, in the text itself ("(default: ...)")."""
    p = argparse.ArgumentParser(
        prog="kvstored",
        description="KVDrive storage daemon: holds every sequence's KV blocks in a DRAM tier and an SSD tier "
        "and serves sparse block reads to clients over ZeroMQ.",
        epilog="Every option but --config may also be set in the --config file (TOML; keys are the long option "
        "names, e.g. ssd = \"/var/lib/kvstored\", dram = \"96G\"); the command line wins over the file.",
    )
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read options from this TOML file (default: none; options come from the command line only)")
    add_version_option(p)
    _add_storage_options(p)
    _add_socket_options(p)
    _add_io_options(p)
    _add_service_options(p)
    return p


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    """The tiers and the block index: where and how much."""
    p.add_argument("--ssd", default=None, metavar="DIR",
                   help="directory of the SSD tier (data file, LMDB metadata); required, here or in --config")
    p.add_argument("--dram", default=None, metavar="SIZE",
                   help="DRAM tier size, e.g. 512M or 96G (K/M/G/T = powers of 1024); required, here or in --config")
    p.add_argument("--ssd-max", default="1T", metavar="SIZE",
                   help="cap on the SSD tier; puts past it get a 'full' error (default: 1T)")
    p.add_argument("--index-max", default="4G", metavar="SIZE",
                   help="cap on the in-memory block index (32 bytes per (layer, head, page) of each sequence's page "
                        "window, and 256 per page of a block namespace's key table), all users together; puts and creates past it get a 'full' error; refused at start "
                        "if more than the host's memory less --dram (default: 4G)")
    p.add_argument("--index-max-per-uid", default=None, metavar="SIZE",
                   help="what one user's (uid's) sequences may take of --index-max, less than it so that other "
                        "users keep room; that user's puts and creates past it get a 'full' error "
                        "(default: 7/8 of --index-max)")


def _add_socket_options(p: argparse.ArgumentParser) -> None:
    """The sockets clients reach and what one session may map."""
    p.add_argument("--listen", default="", metavar="ADDR",
                   help=f"ipc://PATH or tcp://127.0.0.1:PORT (default: ipc://{default_runtime_dir()}/kvstored.sock)")
    p.add_argument("--session-socket", default="", metavar="PATH",
                   help="the session socket clients open sessions and register buffers on (default: the ipc socket's "
                        "path + '.session', or kvstored.session in the runtime directory)")
    p.add_argument("--socket-mode", default="0660", metavar="MODE",
                   help="permissions of both sockets (octal): who may connect; what a client may touch is decided "
                        "by its uid, which the kernel reports (default: 0660)")
    p.add_argument("--max-client-buffers", default="256G", metavar="SIZE",
                   help="client buffer bytes one session may register (default: 256G)")
    p.add_argument("--max-mapped", default="16T", metavar="SIZE",
                   help="client buffer bytes all sessions together may register (the daemon maps them) (default: 16T)")


def _add_io_options(p: argparse.ArgumentParser) -> None:
    """How the SSD is read and written."""
    p.add_argument("--io-threads", type=int, default=8, metavar="N",
                   help="threads issuing SSD reads (posix and kvikio engines) (default: 8)")
    p.add_argument("--get-workers", type=int, default=4, metavar="N",
                   help="gets that read the SSD served at once (small DRAM-only gets are served on the main thread) "
                        "(default: 4)")
    p.add_argument("--max-gap", default="64K", metavar="SIZE",
                   help="read through holes up to this size when coalescing (default: 64K)")
    p.add_argument("--max-io", default="4M", metavar="SIZE", help="largest single read (default: 4M)")
    p.add_argument(
        "--sync", choices=SyncPolicy.ALL, default=SyncPolicy.DURABLE,
        help="durable: a put is acknowledged after fdatasync and an fsynced LMDB commit; "
        "write-behind: acknowledged once in the page cache, flushed within a second (a power loss may lose "
        "acknowledged puts) "
        f"(default: {SyncPolicy.DURABLE})",
    )
    p.add_argument("--write-behind-backlog", default=None, metavar="SIZE",
                   help="with --sync write-behind: how much written data may wait in the page cache for the "
                        "disk before puts wait for it; a burst up to this size is taken at memory speed, a "
                        "longer stream at the disk's (default: 512M)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="SSD read engine: auto takes kvikio where cuFile reports GPUDirect Storage active, else Linux AIO on an "
                        "O_DIRECT file, else preadv on --io-threads threads (default: auto)")
    p.add_argument("--no-direct", action="store_true",
                   help="buffered I/O instead of O_DIRECT (reads may hit the page cache) (default: O_DIRECT)")


def _add_service_options(p: argparse.ArgumentParser) -> None:
    """Metrics, quotas, the embedded mode, connections and logging."""
    p.add_argument("--metrics", default="", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9464; any address "
                        "but loopback (0.0.0.0, ::) lets other hosts read them, with a warning (default: none)")
    p.add_argument("--quota", action="append", default=[], metavar="NS=SIZE",
                   help="a namespace matching the pattern NS (fnmatch: 'vllm/*' is every vLLM namespace, each apart) "
                        "holds at most SIZE; past it, its least recently used sequences are deleted; repeatable, the "
                        "first matching pattern wins (default: no quota)")
    p.add_argument("--parent-pid", type=int, default=0, metavar="PID",
                   help="shut down when process PID is no longer this daemon's parent (embedded daemons use it) "
                        "(default: 0, none)")
    p.add_argument("--ephemeral-dir", default=None, metavar="DIR",
                   help="a private directory holding --ssd: one that does not exist yet is created and removed, "
                        "with everything in it, when the daemon stops; an existing one must be empty, and only what "
                        "the daemon made in it is removed; /, mount points, top-level and system directories and "
                        "home directories are refused (embedded daemons use it, with --parent-pid) (default: none)")
    add_connection_options(p)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="least severe log messages written to stderr (default: INFO)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line over ``--config``'s file; raises :class:`ConfigFileError` for a file it cannot use."""
    args = parser.parse_args(argv)
    if args.config:
        given_quotas = list(args.quota)
        parser.set_defaults(**load_config_file(args.config, parser))
        args = parser.parse_args(argv)
        if given_quotas:  # the command line's --quota options replace the file's, as any flag wins
            args.quota = given_quotas
    for name in ("ssd", "dram"):
        if getattr(args, name) is None:
            parser.error(f"--{name} is required: give it on the command line or in the --config file")
    return args


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(
        ssd_dir=args.ssd,
        dram_bytes=_size("--dram", args.dram),
        ssd_max_bytes=_size("--ssd-max", args.ssd_max),
        index_max_bytes=_size("--index-max", args.index_max),
        index_max_per_uid_bytes=_size("--index-max-per-uid", args.index_max_per_uid) if args.index_max_per_uid else 0,
        address=args.listen,
        io_threads=args.io_threads,
        get_workers=args.get_workers,
        max_gap_bytes=_size("--max-gap", args.max_gap),
        max_io_bytes=_size("--max-io", args.max_io),
        sync=args.sync,
        **({} if args.write_behind_backlog is None else
           {"write_behind_backlog_bytes": _size("--write-behind-backlog", args.write_behind_backlog)}),
        engine=args.engine,
        direct_io=not args.no_direct,
        parent_pid=args.parent_pid,
        ephemeral_dir=args.ephemeral_dir,
        session_socket=args.session_socket,
        socket_mode=_octal(args.socket_mode),
        session_limits=SessionLimits(buffers=BufferLimits(max_bytes=_size("--max-client-buffers", args.max_client_buffers)),
                                     connections=connection_limits(args)),
        max_mapped_bytes=_size("--max-mapped", args.max_mapped),
        metrics_address=args.metrics,
        quotas=tuple(parse_quota(q) for q in args.quota),
    )


def _size(option: str, value: str | int) -> int:
    """A size option's bytes. A size under one 4 KiB page must say it means bytes ("64B"): a
    bare ``dram = 64`` in a config file is far more often a forgotten unit than a 64-byte tier."""
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None
    if 0 < n < 4096 and not str(value).strip().upper().endswith("B"):
        raise ValueError(f"{option} {value!r} is {n} bytes, less than a 4 KiB page: give a unit (e.g. '{value}G'), "
                         f"or write '{value}B' if you mean bytes")
    return n


def parse_quota(text: str) -> tuple[str, int]:
    """``NS=SIZE`` -> (pattern, bytes); ValueError naming the option for anything else."""
    pattern, sep, size = str(text).rpartition("=")
    if not sep or not pattern or not size:
        raise ValueError(f"--quota {text!r} is not NS=SIZE, e.g. 'vllm/*=200G'")
    try:
        limit = parse_size(size)
    except ValueError as exc:
        raise ValueError(f"--quota {text!r}: {exc}") from None
    if limit < 1 << 20:
        raise ValueError(f"--quota {text!r}: SIZE must be at least 1M")
    return pattern, limit


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise ValueError(f"--socket-mode {text!r} is not an octal mode such as 0660") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
    except ConfigFileError as exc:
        print(f"kvstored: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"kvstored: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.config:
        log.info("options from %s (flags on the command line win)", args.config)
    from kvstored.preflight import PreflightError, remove_empty, run_checks  # noqa: PLC0415 - keep --help fast

    made: list[Path] = []  # directories made for --ssd: a start refused later leaves none of them empty
    try:
        ephemeral = run_checks(cfg, str(args.dram), made)
    except PreflightError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_CANNOT_START
    if not cfg.dram_bytes:
        log.info("--dram 0: no DRAM tier; every get reads the SSD (and the page cache, with --no-direct)")
    if args.write_behind_backlog is not None and cfg.sync != SyncPolicy.WRITE_BEHIND:
        log.warning("--write-behind-backlog has no effect with --sync %s (it bounds write-behind's page-cache writes)",
                    cfg.sync)
    code = EXIT_CANNOT_START
    try:
        code = _run(cfg)
        return code
    finally:
        if code == EXIT_CANNOT_START:
            remove_empty(made)
        if ephemeral is not None:  # what kvstored made there, once it has stopped (or failed to start)
            ephemeral.remove()


def _run(cfg: DaemonConfig) -> int:
    """The metrics endpoint (with --metrics), then the store, until the daemon stops."""
    metrics = None
    if cfg.metrics_endpoint is not None:
        from kvstored.metrics import Metrics, MetricsPortError  # noqa: PLC0415

        metrics = Metrics()
        try:
            metrics.serve(*cfg.metrics_endpoint)
        except MetricsPortError as exc:
            log.error("cannot start: %s", exc)
            return EXIT_CANNOT_START
    try:
        return _serve(cfg, metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _serve(cfg: DaemonConfig, metrics: "Metrics | None") -> int:
    from kvstored.server import Server, install_signal_handlers  # noqa: PLC0415 - keep --help fast

    # The modules' objects (~110K: numpy, numba, zmq, lmdb) live as long as the daemon. Frozen
    # out of the cyclic collector, a full collection no longer walks them: 60-100 ms each, on
    # the thread serving requests, every 10-40 s under steady gets. (Frozen before the store
    # opens: a sequence loaded now and deleted later must stay collectable. No collection
    # first: it would add as much to every start, for the little garbage imports leave.)
    gc.freeze()
    try:
        server = Server(cfg, metrics)
    except Exception as exc:  # start-up failures are reported plainly, not as a traceback
        log.error("cannot start: %s", startup_reason(exc))
        log.debug("cannot start", exc_info=True)
        return EXIT_CANNOT_START
    try:
        server.bind()
    except Exception as exc:  # a socket directory refused, another daemon on the socket, ...
        log.error("cannot start: %s", startup_reason(exc))
        log.debug("cannot start", exc_info=True)
        server.store.close()
        return EXIT_CANNOT_START
    install_signal_handlers(server)
    from kvstored.notify import notify  # noqa: PLC0415 - keep --help fast

    notify("READY=1", f"STATUS=serving {cfg.bind_address}", f"MAINPID={os.getpid()}")
    try:
        server.serve_forever()
    finally:
        notify("STOPPING=1")
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
