"""``kvstored --metrics HOST:PORT``: the daemon's figures in Prometheus text format.

Everything but the two latency histograms is read at scrape time from what the
daemon keeps anyway (the store's counters behind the ``stats`` op, the tiers, the
session table, the error tally), so serving metrics adds no work to a request
beyond one histogram observation for a get or a put. The families live in a
private registry: nothing else in the process can add to or collide with them.

| family | type | labels | what |
| --- | --- | --- | --- |
| ``kvstored_tier_bytes`` | gauge | tier | bytes held (DRAM slots in use; SSD live extents) |
| ``kvstored_tier_capacity_bytes`` | gauge | tier | ``--dram``; ``--ssd-max`` |
| ``kvstored_tier_blocks`` | gauge | tier | blocks held |
| ``kvstored_dram_hits_total`` | counter | | blocks gets copied from DRAM |
| ``kvstored_dram_evictions_total`` | counter | | blocks dropped from DRAM for room |
| ``kvstored_gets_total`` / ``kvstored_puts_total`` | counter | | gets served / puts stored |
| ``kvstored_get_latency_seconds`` / ``kvstored_put_latency_seconds`` | histogram | | of those |
| ``kvstored_put_bytes_total`` | counter | | bytes puts stored |
| ``kvstored_ssd_blocks_read_total`` | counter | | blocks gets read from the SSD |
| ``kvstored_ssd_read_bytes_total`` | counter | | bytes SSD reads read |
| ``kvstored_ssd_reads_total`` | counter | | SSD reads issued (coalesced) |
| ``kvstored_errors_total`` | counter | code | error replies, by protocol error code |
| ``kvstored_sessions`` | gauge | | client sessions open |
| ``kvstored_buffers`` / ``kvstored_buffer_bytes`` | gauge | | client buffers registered, their bytes |
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstored.server import Server

log = logging.getLogger(__name__)

# From a DRAM-only get of a few blocks (tens of µs) to a durable put group or a get
# of many SSD reads on a busy disk (seconds).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0)


class MetricsPortError(RuntimeError):
    """The --metrics address cannot be served; the message says what to change."""


class Metrics:
    """The registry, the request-path histograms, and the HTTP endpoint serving them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # Observed where a get or put is answered ok: from when the daemon started
        # serving the request to its reply (a put's includes its group commit).
        self.get_latency = Histogram("kvstored_get_latency_seconds", "Latency of gets answered ok",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.put_latency = Histogram("kvstored_put_latency_seconds", "Latency of puts answered ok",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self._collector = DaemonCollector()
        self.registry.register(self._collector)
        self._httpd = None
        self._thread: threading.Thread | None = None

    def watch(self, server: "Server") -> None:
        """Report ``server``'s figures from now on (before this, a scrape sees the histograms only)."""
        self._collector.server = server

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` on a daemon thread; a port that cannot be
        bound is a :class:`MetricsPortError`."""
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except socket.gaierror as exc:
            raise MetricsPortError(f"--metrics {where}: cannot resolve host {host!r} ({exc.strerror}); "
                                   "give an address of this host, e.g. 127.0.0.1") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortError(f"--metrics {where}: port {port} is already in use (another kvstored?); "
                                       "choose another --metrics port") from None
            raise MetricsPortError(f"--metrics {where}: cannot listen there ({exc.strerror or exc}); "
                                   "give an address of this host and a free port, e.g. 127.0.0.1:9464") from None
        self._thread.name = "kvstored-metrics"
        log.info("metrics on http://%s/metrics", where)

    def close(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None


class DaemonCollector(Collector):
    """Reads the daemon's live figures at scrape time (on the HTTP server's thread)."""

    def __init__(self) -> None:
        self.server: "Server | None" = None

    def collect(self) -> Iterator[Metric]:
        server = self.server
        if server is None:
            return
        store = server.store
        counters = dict(store.counters)  # one copy: the figures of one scrape agree with each other
        dram_bytes, dram_blocks = store.dram.usage()
        ssd_blocks = store.index.stored_blocks  # every stored block has its SSD copy

        by_tier = GaugeMetricFamily("kvstored_tier_bytes", "Bytes held by each tier", labels=["tier"])
        by_tier.add_metric(["dram"], dram_bytes)
        by_tier.add_metric(["ssd"], store.ssd.used_bytes)
        yield by_tier
        capacity = GaugeMetricFamily("kvstored_tier_capacity_bytes", "Size of each tier (--dram, --ssd-max)",
                                     labels=["tier"])
        capacity.add_metric(["dram"], store.dram.capacity)
        capacity.add_metric(["ssd"], store.ssd.allocator.capacity)
        yield capacity
        blocks = GaugeMetricFamily("kvstored_tier_blocks", "Blocks held by each tier", labels=["tier"])
        blocks.add_metric(["dram"], dram_blocks)
        blocks.add_metric(["ssd"], ssd_blocks)
        yield blocks

        for name, key, text in (
            ("kvstored_dram_hits", "blocks_dram", "Blocks gets copied from the DRAM tier"),
            ("kvstored_dram_evictions", "dram_evicted", "Blocks dropped from the DRAM tier to make room"),
            ("kvstored_gets", "gets", "Gets served"),
            ("kvstored_puts", "puts", "Puts stored"),
            ("kvstored_put_bytes", "bytes_put", "Bytes puts stored"),
            ("kvstored_ssd_blocks_read", "blocks_ssd", "Blocks gets read from the SSD tier"),
            ("kvstored_ssd_read_bytes", "ssd_bytes_read", "Bytes read from the SSD tier (holes up to --max-gap included)"),
            ("kvstored_ssd_reads", "ssd_reads", "SSD reads issued (coalesced: one read may carry many blocks)"),
        ):
            yield CounterMetricFamily(name, text, value=counters.get(key, 0))

        errors = CounterMetricFamily("kvstored_errors", "Error replies sent, by protocol error code", labels=["code"])
        for code, count in server.errors.snapshot().items():
            errors.add_metric([code.value], count)
        yield errors

        sessions = server.sessions
        yield GaugeMetricFamily("kvstored_sessions", "Client sessions open", value=len(sessions))
        yield GaugeMetricFamily("kvstored_buffers", "Client buffers registered", value=sessions.buffer_count())
        yield GaugeMetricFamily("kvstored_buffer_bytes", "Bytes of client buffers registered (mapped by the daemon)",
                                value=sessions.budget.used)
