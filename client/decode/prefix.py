"""A reused prompt's stored pages (``reuse=True``): a kept sequence per batch row, named by
the model and the prompt's tokens (:meth:`kvdrive_client.handle.Handle._restore`), holding
the prompt's pages below ``StoreIO.base_pages``.

They are only what the prompt computes, so a session never writes over stored pages it did
not create, nor waits for them: where they are incomplete and another process is storing
them now (the daemon says whether the session that created them is still open), or a row's
name is taken when the prefill would create it, the session keeps every page in its own
sequences and leaves them alone. Where they are incomplete and no session is writing them
(a process stopped while storing them, or the daemon restarted), it deletes them and stores
the prompt anew (:func:`drop_stale`); where they fail their checksum as they load, or a
decode fetch finds one damaged later, it deletes them (:func:`drop_prefix`, :func:`on_damage`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvdrive.layout.geometry import Geometry
from kvdrive_client.device_cache import HostPlacement
from kvdrive_client.errors import ChecksumError, ExistsError, NotFoundError, StoreError
from kvdrive_client.store import Sequence

if TYPE_CHECKING:
    from kvdrive_client.decode.fetch import StoreIO

log = logging.getLogger(__name__)


def open_prefix(io: StoreIO, names: list[str], prefix_pages: int, restore_pages: int) -> bool:
    """Use the first ``restore_pages`` of every row's ``prefix_pages`` stored pages, if every row
    has them all; where no row has any, store them at prefill (:func:`create_prefix`)."""
    io.base_names, io.base_pages = names, prefix_pages
    if prefix_pages == 0:
        return False
    seqs = []
    for name in names:
        try:
            seqs.append(io.store.open(io.ctx.cfg.namespace, name))
        except NotFoundError:
            pass
    restore_pages = min(restore_pages, prefix_pages)
    if not seqs:
        if io.windows is not None:
            io.windows.plan(names, restore_pages)
        return False
    if len(seqs) < len(names) or any(s.geometry != io.geometry or s.complete_pages < prefix_pages for s in seqs):
        if not stale(seqs) or any(s.geometry != io.geometry for s in seqs):
            _keep_own(io, "incomplete: another process is storing them" + (
                "" if all(s.writing for s in seqs) else
                f", or one stopped while storing them (delete {seqs[0].ns}/{seqs[0].name} if none is)"))
            return False
        drop_stale(io, seqs)  # and store them at prefill, as where none were stored
        if io.windows is not None:
            io.windows.drop_stale(names, restore_pages)
            io.windows.plan(names, restore_pages)
        return False
    if restore_pages <= 0:
        _keep_own(io, "stored already: the prefill reads the queries of more of the prompt than the tokens after them")
        return False
    why = "" if io.windows is None else io.windows.find(names, restore_pages)
    if why:
        _keep_own(io, why)
        return False
    io.base_seqs, io.base_pages = seqs, restore_pages
    io.restored = True
    return True


def create_prefix(io: StoreIO) -> None:
    """At prefill, the rows' prefix sequences that :func:`open_prefix` planned, and their sliding
    layers' windows (:mod:`.windows`); a name taken by then (another process storing the same
    prompt) leaves them all to it."""
    if io.restored:
        return
    if io.base_names is not None:
        made = create_all(io, io.base_names, io.geometry)
        if made is None:
            _keep_own(io, "being stored by another process")
            if io.windows is not None:
                io.windows.names = None
            return
        io.base_seqs = made
    if io.windows is not None:
        io.windows.create()


def create_all(io: StoreIO, names: list[str], geometry: Geometry) -> list[Sequence] | None:
    """A sequence of each of ``names``, every one made by this session; None (and none made)
    where one of the names is taken."""
    made = []
    try:
        for name in names:
            made.append(io.store.create(io.ctx.cfg.namespace, name, geometry))
    except ExistsError:
        for seq in made:  # empty: nothing of another's is deleted
            io.store.delete(seq.ns, seq.name)
        return None
    return made


def stale(seqs: list[Sequence]) -> bool:
    """Whether no open session of the daemon is writing any of ``seqs``: a process stopped
    while storing them, or the daemon restarted since; incomplete, they stay so."""
    return bool(seqs) and all(s.writing is False for s in seqs)


def drop_stale(io: StoreIO, seqs: list[Sequence]) -> None:
    """Delete :func:`stale` ``seqs``, each only while its name is still that sequence (another
    process that took them over first has made new ones, and keeps them)."""
    for seq in seqs:
        try:
            io.store.delete(seq.ns, seq.name, uid=seq.uid)
        except NotFoundError:
            pass
    log.info("deleted %d stored sequence(s) of this prompt (%s/%s, ...) that a process left incomplete when it "
             "stopped; this session stores them anew", len(seqs), seqs[0].ns, seqs[0].name)


def _keep_own(io: StoreIO, why: str) -> None:
    log.info("not reusing or storing this prompt's stored pages, %s; its pages go to this session's own sequences",
             why)
    io.base_names, io.base_pages, io.base_seqs = None, 0, []


def load_prefix(io: StoreIO, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every restored page of one layer, ``[B, H, P*S, D]`` K and V (:func:`drop_prefix` on damage)."""
    ctx = io.ctx
    sh, p = ctx.shape, io.base_pages
    pages = np.broadcast_to(np.arange(p), (ctx.batch, sh.num_kv_heads, p))
    every = HostPlacement(pages, np.zeros_like(pages), np.ones(pages.shape, dtype=bool))
    try:
        kv = io.wait(io.submit(layer, 0, every, slot=0))
    except ChecksumError as exc:
        raise drop_prefix(io, exc) from exc
    kf, vf = kv[:, 0], kv[:, 1]
    shape = (ctx.batch, sh.num_kv_heads, p * ctx.cfg.page_size, sh.head_dim)
    # copy=True: kf/vf may be views of the staging buffer, which the next fetch reuses.
    return kf.reshape(shape).to(ctx.device, copy=True), vf.reshape(shape).to(ctx.device, copy=True)


def drop_prefix(io: StoreIO, exc: ChecksumError) -> ChecksumError:
    """Restored pages that failed their checksum: delete them, so that the next generate()
    prefills the prompt and stores it again; the error to raise (this one has run past its prefill)."""
    for seq in io.base_seqs + (io.windows.seqs if io.windows is not None else []):
        try:
            io.store.delete(seq.ns, seq.name, uid=seq.uid)  # not another's, made since under the same name
        except NotFoundError:
            pass
        except StoreError as err:
            log.warning("could not delete the damaged stored prompt %s/%s: %s", seq.ns, seq.name, err)
    err = ChecksumError(f"{exc}; this reused prompt's stored pages were deleted: the next generate() "
                        "prefills it and stores it again")
    err.prompt_dropped = True
    return err


def on_damage(io: StoreIO, exc: ChecksumError) -> ChecksumError:
    """A checksum failure that ends a generate() of a reused prompt (a decode fetch found a
    page damaged after the restore had loaded it whole): the page may be the prompt's, so
    its stored pages go too (:func:`drop_prefix`); ``exc`` itself where nothing was restored
    or they went already."""
    if not io.restored or getattr(exc, "prompt_dropped", False):
        return exc
    return drop_prefix(io, exc)
