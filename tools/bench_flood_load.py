"""The flooding tenant of ``kvdrive-bench flood``: one process, run as
``python -m kvdrive.tools.bench_flood_load SPEC_JSON``.

Life cycle, over its standard streams:

1. it sets up (connects; for ``ssd-gets``, puts its data once, untimed) and starts
   flooding; once every connection has had a reply it writes ``ready``;
2. it floods until a line (or the end) arrives on its standard input, or
   ``max_seconds`` pass;
3. it writes one JSON line: requests served (``ok``), errors by type, and what the
   kind measures besides.

Kinds (:class:`FloodKind`):

- ``connections``: ``connections`` plain ZeroMQ connections to the daemon's socket, each
  asking one hello (no session needed) and then idle, plus ``session_connections``
  connections to its session socket that never send a byte; each ZeroMQ connection
  asks a second hello at the end, to tell whether the daemon still serves them;
- ``list``, ``puts4m``, ``ssd-gets``: ``connections`` clients (one thread, one
  ZeroMQ connection and one session each), each sending its next request as soon
  as the last one is answered. ``list`` lists every sequence of the uid, which first
  creates :data:`LIST_SEQUENCES` empty ones; ``puts4m`` puts 4 MiB of fresh pages
  (durable); ``ssd-gets`` gets :data:`GET_BLOCKS` random blocks of a sequence of
  ``ssd_data_bytes``, put first.

Every request has a deadline of :data:`REQUEST_TIMEOUT_S`; a connection whose daemon is
gone (:class:`~kvdrive_client.errors.StoreUnavailableError`) stops. :class:`FloodProcess`
is the measuring process's end of all this.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import zmq

from kvdrive.protocol import Op, decode_reply, request_frames
from kvdrive_client import Geometry, NotFoundError, StoreClient, StoreError, StoreUnavailableError

REQUEST_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 20.0  # for every connection's first reply
SETUP_TIMEOUT_S = 180.0  # from start to "ready": the ssd-gets data is put first
FINISH_TIMEOUT_S = 30.0  # from "stop" to the result
LAST_HELLO_TIMEOUT_S = 5.0  # the daemon answered these connections before: it need not accept them again
# The flood's blocks: Llama-3-8B's (8 KV heads x head dim 128, fp16, 16-token pages: 8 KiB).
GEOMETRY = Geometry(1, 8, 128, "float16", 16)
PUT_PAGES = 64  # 1 layer x 8 heads x 64 pages x 8 KiB = 4 MiB a put
PUT_BYTES = GEOMETRY.num_kv_heads * PUT_PAGES * GEOMETRY.block_bytes
PUTS_PER_SEQUENCE = 32  # then the sequence is deleted: a connection holds 128 MiB at most
GET_BLOCKS = 64  # blocks of one sparse get: 512 KiB
LIST_SEQUENCES = 256  # empty sequences the list flood's uid holds, as a tenant with many prompts would
NAMESPACE = "flood"
SSD_DATA = "ssd-data"


class FloodKind(enum.Enum):
    CONNECTIONS = "connections"
    LIST = "list"
    PUTS4M = "puts4m"
    SSD_GETS = "ssd-gets"


@dataclass(frozen=True)
class FloodSpec:
    kind: FloodKind
    address: str
    connections: int
    session_connections: int = 0
    ssd_data_bytes: int = 0
    max_seconds: float = 60.0
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "kind": self.kind.value})

    @classmethod
    def from_json(cls, text: str) -> "FloodSpec":
        d = json.loads(text)
        return cls(**{**d, "kind": FloodKind(d["kind"])})


@dataclass
class Tally:
    """What one connection got: requests answered, errors by type, and the kind's own counts."""

    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    lost: bool = False  # the daemon went away under it

    def add(self, other: "Tally") -> None:
        self.ok += other.ok
        self.errors.update(other.errors)
        self.counts.update(other.counts)
        self.lost = self.lost or other.lost


# ---------------------------------------------------------------- request floods


class RequestLoop(abc.ABC):
    """One connection's flood: ``setup`` once, then ``step`` until told to stop."""

    def __init__(self, spec: FloodSpec, index: int) -> None:
        self.spec, self.index = spec, index

    def setup(self, client: StoreClient) -> None:
        pass

    @abc.abstractmethod
    def step(self, client: StoreClient, tally: Tally) -> None:
        """Send one request (a list: one page after another) and wait for the reply, counting it in ``tally``."""

    def close(self, client: StoreClient) -> None:
        pass


class ListLoop(RequestLoop):
    """Lists of every sequence of the uid, which holds :data:`LIST_SEQUENCES` of the flood's
    besides: one step pages through them all (kvstored replies with a page of 16 at most)."""

    def setup(self, client: StoreClient) -> None:
        for k in range(self.index, LIST_SEQUENCES, self.spec.connections):
            client.create(NAMESPACE, f"list-{k}", GEOMETRY, exist_ok=True)

    def step(self, client: StoreClient, tally: Tally) -> None:
        tally.counts["sequences_listed"] += len(client.list())


class PutLoop(RequestLoop):
    """4 MiB durable puts of fresh pages; every :data:`PUTS_PER_SEQUENCE` the sequence goes."""

    def setup(self, client: StoreClient) -> None:
        self.buf = random_buffer(client, PUT_BYTES, self.spec.seed + self.index)
        self.generation, self.puts = 0, 0
        self.seq = self._fresh(client)

    def _fresh(self, client: StoreClient):
        self.generation += 1
        return client.create(NAMESPACE, f"puts-{self.index}-{self.generation}", GEOMETRY)

    def step(self, client: StoreClient, tally: Tally) -> None:
        if self.puts == PUTS_PER_SEQUENCE:
            client.delete(NAMESPACE, self.seq.name)
            self.seq, self.puts = self._fresh(client), 0
        client.put_from(self.seq, [0], range(self.puts * PUT_PAGES, (self.puts + 1) * PUT_PAGES), self.buf)
        self.puts += 1
        tally.counts["bytes"] += self.buf.size

    def close(self, client: StoreClient) -> None:
        client.delete(NAMESPACE, self.seq.name)


class SsdGetLoop(RequestLoop):
    """Sparse gets of :data:`GET_BLOCKS` random blocks of a sequence larger than the DRAM tier."""

    def setup(self, client: StoreClient) -> None:
        self.seq = client.open(NAMESPACE, SSD_DATA)
        self.out = client.register(GET_BLOCKS * GEOMETRY.block_bytes)
        self.rng = np.random.default_rng(self.spec.seed + self.index)
        self.pages = self.seq.complete_pages

    def step(self, client: StoreClient, tally: Tally) -> None:
        flat = self.rng.choice(GEOMETRY.num_kv_heads * self.pages, GET_BLOCKS, replace=False)
        heads, pages = np.divmod(flat, self.pages)
        blocks = np.stack([np.zeros_like(heads), heads, pages], axis=1)
        reply = client.get_into(self.seq, blocks, self.out)
        tally.counts["blocks"] += reply["n"]
        tally.counts["ssd_blocks"] += reply["ssd"]


LOOPS = {FloodKind.LIST: ListLoop, FloodKind.PUTS4M: PutLoop, FloodKind.SSD_GETS: SsdGetLoop}


def put_ssd_data(spec: FloodSpec) -> None:
    """The sequence the ``ssd-gets`` flood reads, put once (a daemon that has it keeps it)."""
    with StoreClient(spec.address, timeout=120.0) as client:
        try:
            client.open(NAMESPACE, SSD_DATA)
            return
        except NotFoundError:
            pass
        seq = client.create(NAMESPACE, SSD_DATA, GEOMETRY)
        buf = random_buffer(client, PUT_BYTES, spec.seed)
        for first in range(0, max(1, spec.ssd_data_bytes // PUT_BYTES) * PUT_PAGES, PUT_PAGES):
            client.put_from(seq, [0], range(first, first + PUT_PAGES), buf)


def random_buffer(client: StoreClient, nbytes: int, seed: int):
    """A registered buffer of ``nbytes`` random bytes."""
    buf = client.register(nbytes)
    buf.array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)
    return buf


def one_step(loop: RequestLoop, client: StoreClient, tally: Tally) -> None:
    try:
        loop.step(client, tally)
        tally.ok += 1
    except StoreUnavailableError as exc:
        tally.errors[type(exc).__name__] += 1
        tally.lost = True
    except StoreError as exc:  # busy, full, expired: counted, and the flood goes on
        tally.errors[type(exc).__name__] += 1


def flood_connection(spec: FloodSpec, index: int, stop: threading.Event, started: threading.Event,
                     tally: Tally) -> None:
    loop = LOOPS[spec.kind](spec, index)
    client = StoreClient(spec.address, timeout=REQUEST_TIMEOUT_S)
    try:
        loop.setup(client)
        one_step(loop, client, tally)
        started.set()
        while not stop.is_set() and not tally.lost:
            one_step(loop, client, tally)
        if not tally.lost:
            loop.close(client)
    except StoreError as exc:  # in setup or close
        tally.errors[type(exc).__name__] += 1
        tally.lost = tally.lost or isinstance(exc, StoreUnavailableError)
    finally:
        started.set()
        client.close()


def flood_requests(spec: FloodSpec) -> Tally:
    if spec.kind is FloodKind.SSD_GETS:
        put_ssd_data(spec)
    stop = threading.Event()
    tallies = [Tally() for _ in range(spec.connections)]
    started = [threading.Event() for _ in range(spec.connections)]
    threads = [threading.Thread(target=flood_connection, args=(spec, i, stop, started[i], tallies[i]),
                                name=f"flood-{i}", daemon=True) for i in range(spec.connections)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    for s in started:
        s.wait(max(0.0, deadline - time.monotonic()))
    t0 = announce_ready()
    wait_for_stop(spec.max_seconds)
    stop.set()
    total = Tally()
    total.counts["flood_ms"] = round((time.monotonic() - t0) * 1e3)
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 5.0)
    for t in tallies:
        total.add(t)
    return total


# ---------------------------------------------------------------- connection flood


def hello_all(sockets: list[zmq.Socket], tally: Tally, label: str, timeout: float, watch_stdin: bool = False) -> bool:
    """One hello on every socket: the answered ones within ``timeout`` counted as ``ok`` and in
    ``counts[label]``, the others as errors ``no reply: label``. With ``watch_stdin``, the wait
    also ends when the parent closes standard input (it saw the daemon die): then True."""
    deadline = time.time() + timeout
    poller = zmq.Poller()
    if watch_stdin:
        poller.register(sys.stdin.fileno(), zmq.POLLIN)
    waiting = set()
    for i, s in enumerate(sockets):
        try:
            s.send_multipart(request_frames(Op.HELLO, i, {}, None, None, deadline), zmq.NOBLOCK)
        except zmq.Again:
            tally.errors[f"no reply: {label}"] += 1
            continue
        poller.register(s, zmq.POLLIN)
        waiting.add(s)
    while waiting and time.time() < deadline:
        events = poller.poll(200)
        if any(s == sys.stdin.fileno() for s, _ in events):
            tally.errors[f"no reply: {label}"] += len(waiting)
            return True
        for s, _ in events:
            reply = decode_reply(s.recv_multipart()[-1])
            waiting.discard(s)
            poller.unregister(s)
            if reply.get("ok"):
                tally.ok += 1
                tally.counts[label] += 1
            else:
                tally.errors[f"{label}: {reply.get('code')}"] += 1
    if waiting:
        tally.errors[f"no reply: {label}"] += len(waiting)
    return False


def open_idle_sessions(path: str, count: int, tally: Tally) -> list[socket.socket]:
    """``count`` connections to the session socket that never send."""
    conns = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.settimeout(5.0)
        try:
            s.connect(path)
        except OSError as exc:
            s.close()
            tally.errors[f"session connect: {exc.strerror}"] += 1
            continue
        conns.append(s)
    tally.counts["session_connections"] = len(conns)
    return conns


def raise_descriptor_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def flood_connections(spec: FloodSpec) -> Tally:
    raise_descriptor_limit(2 * (spec.connections + spec.session_connections) + 256)
    tally = Tally()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, spec.connections + 64)
    sockets: list[zmq.Socket] = []
    conns: list[socket.socket] = []
    try:
        for _ in range(spec.connections):
            sockets.append(s := ctx.socket(zmq.DEALER))
            s.setsockopt(zmq.LINGER, 0)
            s.connect(spec.address)
        tally.counts["zmq_connections"] = len(sockets)
        gone = hello_all(sockets, tally, "hellos_first", CONNECT_TIMEOUT_S, watch_stdin=True)
        if not gone:
            conns = open_idle_sessions(spec.address.removeprefix("ipc://") + ".session", spec.session_connections, tally)
        t0 = announce_ready()
        wait_for_stop(spec.max_seconds)
        tally.counts["flood_ms"] = round((time.monotonic() - t0) * 1e3)
        if not gone:
            hello_all(sockets, tally, "hellos_last", LAST_HELLO_TIMEOUT_S)
    finally:
        for c in conns:
            c.close()
        for s in sockets:
            s.close(linger=0)
        ctx.term()
    tally.lost = tally.counts["hellos_last"] == 0
    return tally


# ---------------------------------------------------------------- its parent's end


class FloodProcess:
    """:mod:`kvdrive.tools.bench_flood_load` running ``spec``; killed by :meth:`kill` if still there."""

    def __init__(self, spec: FloodSpec, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvdrive.tools.bench_flood_load", spec.to_json()],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._pending = b""

    def _line(self, timeout: float, alive: Callable[[], bool] | None = None) -> str:
        """The next line it writes; while waiting, once ``alive()`` says the daemon is gone, it is told to stop."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the flooding process said nothing within {timeout:.0f} s:\n{self._log_tail()}")
            if not select.select([fd], [], [], min(left, 0.2))[0]:
                if alive is not None and not self.proc.stdin.closed and not alive():
                    self.proc.stdin.close()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the flooding process exited with {self.proc.wait()}:\n{self._log_tail()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def wait_ready(self, alive: Callable[[], bool]) -> None:
        """Until the flood is on (or, when ``alive()`` turns false, has given up)."""
        line = self._line(SETUP_TIMEOUT_S, alive)
        if line != "ready":
            raise RuntimeError(f"the flooding process said {line!r:.200} instead of 'ready'")

    def finish(self) -> dict:
        """Tell it to stop; what it reports."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        line = "ready"
        while line == "ready":  # a flood whose set-up failed may announce itself twice
            line = self._line(FINISH_TIMEOUT_S)
        self.proc.wait(FINISH_TIMEOUT_S)
        return json.loads(line)

    def _log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if not stream.closed:
                stream.close()


@contextlib.contextmanager
def flooding(spec: FloodSpec, log_path: Path) -> Iterator[FloodProcess]:
    flood = FloodProcess(spec, log_path)
    try:
        yield flood
    finally:
        flood.kill()


# ---------------------------------------------------------------- the process


def announce_ready() -> float:
    """Tell the measuring process the flood is on; the time it was told."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    return time.monotonic()


def wait_for_stop(max_seconds: float) -> None:
    """Until a line or the end arrives on standard input, or ``max_seconds`` pass."""
    select.select([sys.stdin], [], [], max_seconds)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = FloodSpec.from_json(argv[0])
    try:
        tally = flood_connections(spec) if spec.kind is FloodKind.CONNECTIONS else flood_requests(spec)
    except StoreUnavailableError as exc:  # the daemon went away while the flood was set up
        tally = Tally(lost=True)
        tally.errors[type(exc).__name__] += 1
        announce_ready()
    result = {"ok": tally.ok, "errors": dict(tally.errors), "counts": dict(tally.counts), "lost": tally.lost}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
