"""The writer thread: puts, creates and deletes, in turn by user and session, in write groups.

The main thread (server.py) queues catalog changes and puts here (kvstored/turns.py).
The writer takes them one at a time: creates are gathered and created in one catalog
commit, puts prepared (their blocks written to the data file, kvstored/put_path.py),
and a delete runs alone after what was gathered before it. A group closes once its
puts hold ``GROUP_BYTES`` or it holds ``MAX_GROUP`` requests, or the queue is empty, so a
small put waits behind a few MiB of another user's puts, not behind all it sent. The
group is then made durable on the commit thread (kvstored/commits.py) while the writer
writes the next; between requests, the writer publishes the group in commit once it is
durable and answers its puts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvstored.commits import CommitThread, Group
from kvstored.config import DaemonConfig, SyncPolicy
from kvstored.protocol import BlockPut, Create, Delete, Envelope, ErrorCode, ProtocolError, Put, check_deadline, ok_reply
from kvstored.put_path import PreparedPut
from kvstored.sessions import Session
from kvstored.store import Store
from kvstored.turns import FairQueue

log = logging.getLogger(__name__)

# Puts gathered into one durable commit at most, and the bytes after which a group commits
# (the puts of a group are acknowledged together, after its last write and its fsync).
MAX_GROUP = 64
GROUP_BYTES = 16 << 20
_STOP = object()
_COMMITTED = object()  # the commit thread ended a group's commit: the writer publishes it


class Writer:
    """The writer thread over ``store``, taking requests from ``writes``; replies leave by
    ``send`` (frames), errors are framed by ``error``, a delete runs through ``run``."""

    def __init__(self, cfg: DaemonConfig, store: Store, writes: FairQueue, send: Callable[[list], None],
                 error: Callable[..., list], run: Callable[..., None], observe_put: Callable[[float], None]) -> None:
        self.cfg, self.store, self._writes = cfg, store, writes
        self._send, self._error, self._run, self._observe_put = send, error, run, observe_put
        self.commits = CommitThread(store.make_durable, lambda: writes.put(None, None, _COMMITTED))
        self._thread = threading.Thread(target=self._writer_loop, name="kvstored-writer", daemon=True)

    def start(self) -> None:
        self.commits.start()
        self._thread.start()

    def stop(self) -> None:
        """Finish every request queued before this, then end both threads."""
        self._writes.put(None, None, _STOP)
        self._thread.join()
        self.commits.stop()

    def _writer_loop(self) -> None:
        dirty_since: float | None = None
        running = True
        while running:
            try:
                first = self._writes.get(timeout=None if dirty_since is None else 1.0)
            except queue.Empty:
                first = None
            wrote = first is not None and first is not _STOP and first is not _COMMITTED
            running = first is not _STOP and (first is None or self._write_group(first))
            if self.cfg.sync == SyncPolicy.WRITE_BEHIND:
                if wrote and dirty_since is None:
                    dirty_since = time.monotonic()
                # Flushed once the queue was idle a second (no request came), or a second after the
                # first unflushed write; a commit thread's wake-up is neither.
                if dirty_since is not None and (not running or first is None or time.monotonic() - dirty_since >= 1.0):
                    self._finish_commit(wait=True)
                    self._flush()
                    dirty_since = None
        self._finish_commit(wait=True)

    def _flush(self) -> None:
        """Write-behind's flush. One that fails (a disk error, or a filesystem that found no
        room for pages the page cache had taken) is counted and logged; the writer goes on."""
        try:
            self.store.sync()
        except OSError as exc:
            self.store.counters["flushes_failed"] += 1
            log.error("a write-behind flush failed (%s): puts acknowledged since the last flush may be lost; a get "
                      "reports each such block damaged, never other bytes", exc)

    def _write_group(self, item) -> bool:
        """Write ``item`` and what follows it in the queue's turns, until the group holds
        ``MAX_GROUP`` requests or ``GROUP_BYTES`` of puts or the queue is empty, then hand it
        to the commit thread. Requests are taken one at a time, so one that arrives meanwhile
        takes its turn in this group or the next; between them, the group before, once
        durable, is published and answered. False if the queue said stop."""
        prepared: list[tuple[bytes, int, PreparedPut | None, float]] = []
        creates: list[tuple[bytes, Envelope, Session]] = []
        taken, group_bytes = 0, 0
        while item is not None and item is not _STOP:
            if item is not _COMMITTED:
                taken += 1
                group_bytes += self._write_one(item, prepared, creates)
                if self._writes_between(item):
                    creates, prepared = [], []
            self._finish_commit(wait=False)
            if taken >= MAX_GROUP or group_bytes >= GROUP_BYTES:
                break
            try:
                item = self._writes.get_nowait()
            except queue.Empty:
                item = None
        self._create_group(creates)
        self._start_commit(prepared)
        return item is not _STOP

    def _write_one(self, item, prepared: list, creates: list) -> int:
        """Take one request of a group: gather a create, prepare a put (the bytes it writes);
        a delete commits what was gathered first and runs alone (see _writes_between)."""
        ident, env, session, t0 = item
        req_id, req = env.req_id, env.request
        if isinstance(req, Create):
            # Creates commit together (an engine creates a sequence per block, many at once).
            creates.append((ident, env, session))
        elif isinstance(req, (Put, BlockPut)):
            try:
                check_deadline(env)
                if isinstance(req, Put):
                    p = self.store.prepare_put(req, session)
                else:  # None: every block is stored, or being stored by this group; answered with it
                    p = self.store.blocks.prepare_put(req, session) or _NothingToWrite(len(req.keys))
                prepared.append((ident, req_id, p, t0))
                return p.nbytes
            except ProtocolError as exc:
                self._send([ident, *self._error(req_id, exc.code, str(exc))])
            except Exception as exc:
                log.exception("internal error preparing put %s", req_id)
                self._send([ident, *self._error(req_id, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")])
        else:
            # A delete commits on its own, after the creates and puts gathered so far.
            self._create_group(creates)
            self._start_commit(prepared)
            self._finish_commit(wait=True)
            delete = self.store.delete if isinstance(req, Delete) else self.store.blocks.delete
            self._run(ident, env, lambda req=req, session=session, delete=delete: delete(req, session.uid))
        return 0

    @staticmethod
    def _writes_between(item) -> bool:
        """Whether ``item`` committed the group gathered before it (a delete)."""
        return not isinstance(item[1].request, (Create, Put, BlockPut))

    def _create_group(self, creates: list[tuple[bytes, Envelope, Session]]) -> None:
        """Create the sequences of a batch's creates in one catalog commit, each told its own
        result. A put names a sequence created before it was sent, so creates need not wait
        for the puts around them; a delete commits both groups gathered before it first."""
        if creates:  # after every put sent before them is published
            self._finish_commit(wait=True)
        live = []
        for ident, env, session in creates:
            try:
                check_deadline(env)
                live.append((ident, env, session))
            except ProtocolError as exc:
                self._send([ident, *self._error(env.req_id, exc.code, str(exc))])
        if not live:
            return
        try:
            results = self.store.create_many([(env.request, session.uid) for _, env, session in live],
                                             [session.token for _, _, session in live])
        except Exception as exc:
            log.exception("internal error creating %d sequences", len(live))
            results = [ProtocolError(ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")] * len(live)
        for (ident, env, _), result in zip(live, results):
            if isinstance(result, ProtocolError):
                self._send([ident, *self._error(env.req_id, result.code, str(result))])
            else:
                self._send([ident, *ok_reply(env.req_id, **result)])

    def _start_commit(self, prepared: list[tuple[bytes, int, PreparedPut, float]]) -> None:
        """Commit a write group, after the group before it is published (one group in commit
        at a time: groups are durable and visible in order). With more requests waiting, the
        commit thread commits it while this thread writes them; with none, it is committed
        here, which spares an idle daemon's put a hand-over between threads. A group with
        nothing to write is answered at once."""
        self._finish_commit(wait=True)
        writes = [p for _, _, p, _ in prepared if isinstance(p, PreparedPut)]
        if not writes:
            if prepared:
                self._answer(prepared, {})
            return
        group = Group(prepared, writes)
        if len(self._writes):
            self.commits.submit(group)
            return
        self.commits.commit_here(group)
        self._published(group)

    def _finish_commit(self, wait: bool) -> None:
        """Publish and answer the group on the commit thread once its commit has ended
        (waiting for that if ``wait``)."""
        group = self.commits.take(wait)
        if group is not None:
            self._published(group)

    def _published(self, group: Group) -> None:
        """Publish a group whose commit ended, and answer its puts. Only the shared commit
        (fsync, LMDB) fails the whole group, and then none of it is durable; a put the
        store could not publish is refused alone."""
        prepared, writes, exc = group.prepared, group.writes, group.error
        if exc is not None:
            self.store.abort_puts(writes)
            if isinstance(exc, ProtocolError):
                self.store.counters["commits_failed"] += 1
                log.error("commit of %d puts failed: %s", len(prepared), exc)
                code, text = exc.code, str(exc)
            else:
                log.error("commit of %d puts failed", len(prepared), exc_info=exc)
                code, text = ErrorCode.INTERNAL, f"commit failed: {exc.__class__.__name__}: {exc}"
            for ident, req_id, _, _ in prepared:
                self._send([ident, *self._error(req_id, code, text)])
            return
        try:
            refused = {id(writes[i]): err for i, err in self.store.publish_puts(writes).items()}
        except Exception as exc:  # a bug: the puts are durable, and visible after a restart
            log.exception("publishing %d committed puts failed", len(prepared))
            refused = {id(p): ProtocolError(ErrorCode.INTERNAL, f"publishing failed: {exc.__class__.__name__}: {exc}")
                       for p in writes}
        try:
            self.store.enforce_quotas([p for p in writes if id(p) not in refused])
        except Exception:  # the puts are durable and visible: an eviction that failed is retried at the next commit
            log.exception("enforcing --quota after a commit failed")
        self._answer(prepared, refused)

    def _answer(self, prepared: list[tuple[bytes, int, PreparedPut, float]], refused: dict) -> None:
        for ident, req_id, p, t0 in prepared:
            if id(p) in refused:
                self._send([ident, *self._error(req_id, refused[id(p)].code, str(refused[id(p)]))])
            else:
                self._observe_put(time.perf_counter() - t0)
                self._send([ident, *ok_reply(req_id, **(p.reply or {"blocks": len(p.pages)}))])


class _NothingToWrite:
    """A block put whose keys are all stored or being stored: answered after its group's
    commit, which makes durable any of them that another put of the group writes."""

    def __init__(self, num_keys: int) -> None:
        self.reply = {"stored": 0, "present": num_keys}
        self.nbytes = 0
