"""Session behaviour without a daemon: SparseKV over the in-process FakeStore.

What is stored (every page once, byte-exact, before it is fetched), what is fetched
(nothing more once the cache holds every page), what is attended (the sink pages,
from slots holding their bytes; never a padding token), and that the kernel sets and
the pipeline's schedules agree. The last tests check FakeStore against a real kvstored.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from fake_store import FakeStore

from kvdrive_client.decode import attention
from kvdrive_client.engine import ModelShape, SparseKV
from kvdrive_client.errors import ExistsError, NotFoundError
from kvdrive_client.store import Sequence

H, HQ, D, L, S = 2, 4, 32, 2, 16  # KV heads, query heads, head dim, layers, page size (AttachConfig's default)
SHAPE = ModelShape(L, H, HQ, D, torch.float32)


@dataclass
class Result:
    outs: torch.Tensor  # [steps, layers, B, HQ, D]
    stats: dict
    marks: dict  # (step, layer) -> the store's event clock before and after that decode call
    restored: bool


class Decode:
    """A seeded prompt and decode inputs: per layer Q/K/V of the prompt, per step and layer
    one token's. Padding positions of left-padded rows hold large constants, so any of
    them that reached an output would show."""

    def __init__(self, B: int = 2, T: int = 200, steps: int = 24, seed: int = 0, pads: tuple[int, ...] | None = None):
        g = torch.Generator().manual_seed(seed)
        self.B, self.T, self.num_steps = B, T, steps
        self.pads = pads or (0,) * B
        self.valid = torch.ones(B, T, dtype=torch.bool)
        for row, pad in enumerate(self.pads):
            self.valid[row, :pad] = False
        self.prefill = []
        for _ in range(L):
            q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (HQ, H, H))
            pad = ~self.valid[:, None, :, None]
            self.prefill.append((q, k.masked_fill(pad, 8.0), v.masked_fill(pad, 100.0)))
        self.steps = [[tuple(torch.randn(B, n, D, generator=g) for n in (HQ, H, H)) for _ in range(L)]
                      for _ in range(steps)]

    def row(self, r: int) -> "Decode":
        """Row ``r`` alone, without its padding: the same tokens, a batch of one."""
        one = object.__new__(Decode)
        pad = self.pads[r]
        one.B, one.T, one.num_steps, one.pads = 1, self.T - pad, self.num_steps, (0,)
        one.valid = torch.ones(1, one.T, dtype=torch.bool)
        one.prefill = [tuple(x[r : r + 1, :, pad:] for x in qkv) for qkv in self.prefill]
        one.steps = [[tuple(x[r : r + 1] for x in qkv) for qkv in step] for step in self.steps]
        return one

    @property
    def shift(self) -> int:
        """KVDrive's padding before the prompt: its pages end where the prompt does."""
        return -self.T % S

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's K and V of a layer, prompt then decode: ``[B, H, T + steps, D]``."""
        _, k, v = self.prefill[layer]
        dk = [step[layer][1][:, :, None] for step in self.steps]
        dv = [step[layer][2][:, :, None] for step in self.steps]
        return torch.cat([k, *dk], dim=2), torch.cat([v, *dv], dim=2)

    def block(self, layer: int, row: int, head: int, page: int) -> bytes:
        """The bytes the store should hold for a page: its K, then its V (the shift's tokens zeros)."""
        k, v = (torch.cat([x.new_zeros(*x.shape[:2], self.shift, D), x], dim=2) for x in self.kv(layer))
        at = slice(page * S, (page + 1) * S)
        return torch.stack([k[row, head, at], v[row, head, at]]).contiguous().numpy().tobytes()

    def run(self, store, steps: int | None = None, restore: tuple[list[str], int] | None = None,
            **options) -> Result:
        kv = SparseKV(store, SHAPE, batch=self.B, **options)
        clock = store.now if isinstance(store, FakeStore) else (lambda: 0)
        restored = kv.session.try_restore(*restore, kv.session.prompt_shift(self.T)) if restore else False
        cut = restore[1] * S - self.shift if restored else 0
        for layer in range(L):
            q, k, v = self.prefill[layer]
            kv.prefill(layer, q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], None if cut else self.valid)
        outs, marks = [], {}
        for step in range(self.num_steps if steps is None else steps):
            for layer in range(L):
                before = clock()
                outs.append(kv.decode(layer, *self.steps[step][layer]))
                marks[(step, layer)] = (before, clock())
        stats = dict(kv.stats)
        kv.close()
        n = len(outs) // L
        out = torch.stack(outs).reshape(n, L, self.B, HQ, D) if outs else torch.empty(0)
        return Result(out, stats, marks, restored)


def seq_of(store: FakeStore, row: int, ns: str = "kvdrive") -> Sequence:
    """The session's store sequence of a batch row (named ``<uuid>-<row>``, kept with keep=True)."""
    names = [n for n in store.names(ns) if n.endswith(f"-{row}") and not n.startswith("prefix")]
    assert len(names) == 1, names
    return store.open(ns, names[0])


def fetched(store: FakeStore, since: int = 0) -> Counter:
    """How often each (uid, layer, head, page) was fetched by gets at or after event ``since``."""
    seen: Counter = Counter()
    for rec in store.get_log:
        if rec.event >= since:
            seen.update((int(u), *map(int, b)) for u, b in zip(rec.uids, rec.blocks))
    return seen


# ---------------------------------------------------------------- what is stored


def test_every_complete_prefill_page_is_put_once_byte_exact():
    # 13 complete pages: 8 tokens of KVDrive's padding, then the 200 (row 1's first 37 are padding too)
    d = Decode(B=2, T=200, pads=(0, 37))
    store = FakeStore()
    d.run(store, steps=0, keep=True)
    pages = (200 + d.shift) // S
    for row in range(2):
        seq = seq_of(store, row)
        blocks = store.sequence_blocks(seq)
        # Every (layer, head, page) of the complete pages, padding pages included.
        assert set(blocks) == {(layer, h, p) for layer in range(L) for h in range(H) for p in range(pages)}
        for (layer, h, p), data in blocks.items():
            assert data == d.block(layer, row, h, p), (row, layer, h, p)
        assert seq.complete_pages == pages
        # One put per layer (and row) with every page, each with a finite importance.
        puts = [(r.layers, r.pages) for r in store.put_log if r.uid == seq.uid]
        assert sorted(puts) == [((layer,), tuple(range(pages))) for layer in range(L)]
        assert all(np.isfinite(store.importance[(seq.uid, *k)]) for k in blocks)
    # The padding pages of row 1 carry no importance: no real token is in them.
    padded = seq_of(store, 1).uid
    assert all(store.importance[(padded, layer, h, p)] == 0 for layer in range(L) for h in range(H) for p in (0, 1))
    assert store.importance[(padded, 0, 0, 2)] > 0  # page 2 holds tokens 37..39


def test_a_page_completed_while_decoding_is_put_once_after_every_layer_and_before_it_is_fetched():
    # Prompt 200 tokens after 8 of KVDrive's padding (pages 0..12); decode 48 tokens completes pages
    # 13, 14, 15 at steps 15, 31 and 47. local_tokens=16 makes a page selectable one page after it
    # completes; budget 1.0 with no cache (cache_multiplier=0) fetches every selectable page every step.
    d = Decode(B=2, T=200, steps=48, pads=(0, 21))
    store = FakeStore()
    res = d.run(store, keep=True, budget=1.0, cache_multiplier=0, local_tokens=16, pipeline=False)
    assert res.stats["pages_flushed"] == 3
    for page, step in ((13, 15), (14, 31), (15, 47)):
        for row in range(2):
            seq = seq_of(store, row)
            puts = [r for r in store.put_log if r.uid == seq.uid and page in r.pages]
            assert len(puts) == 1, (page, row, puts)
            put = puts[0]
            assert put.layers == tuple(range(L)) and put.pages == (page,)
            # Put while the last layer decoded the step that completed it: every layer had completed it.
            lo, hi = res.marks[(step, L - 1)]
            assert lo < put.event < hi, (page, row, put.event, lo, hi)
            for layer in range(L):
                for h in range(H):
                    assert store.blocks[(seq.uid, layer, h, page)] == d.block(layer, row, h, page)
            gets = [rec.event for rec in store.get_log if ((rec.uids == seq.uid) & (rec.blocks[:, 2] == page)).any()]
            assert all(e > put.event for e in gets)
            if page < 15:  # page 15 completes on the last step: never selectable
                assert gets, (page, row)


# ---------------------------------------------------------------- what is fetched


def test_a_cache_that_holds_every_page_fetches_each_page_once_and_then_stops():
    # budget 1.0 at cache_multiplier 4: the cache holds every page. Prefill (200 tokens after 8 of
    # KVDrive's padding) seeds pages 0..8 (the local window holds the last 64 tokens); pages 9, 10, 11
    # leave the local window at steps 15, 31 and 47.
    d = Decode(B=2, T=200, steps=48)
    store = FakeStore()
    res = d.run(store, keep=True, budget=1.0, cache_multiplier=4, pipeline=False)
    seen = fetched(store)
    assert seen and max(seen.values()) == 1  # no block fetched twice
    assert {page for (_, _, _, page) in seen} == {9, 10, 11}
    assert len(seen) == 3 * 2 * L * H == res.stats["misses"]
    # Gets happen only in the steps where a page leaves the local window.
    steps_with_gets = {step for (step, _), (lo, hi) in res.marks.items()
                       if any(lo < rec.event < hi for rec in store.get_log)}
    assert steps_with_gets == {15, 31, 47}
    assert res.stats["hits"] > 10 * res.stats["misses"]

    # The same decode without a cache fetches every selected page every step.
    uncached = FakeStore()
    none = d.run(uncached, budget=1.0, cache_multiplier=0, pipeline=False)
    assert none.stats["hits"] == 0
    assert uncached.counts["blocks_fetched"] > 20 * store.counts["blocks_fetched"]


@pytest.mark.parametrize("index", ["lowrank", "hierarchical"])
def test_cpu_and_reference_kernels_decode_alike(int16_lowrank, index):
    d = Decode(B=3, T=320, steps=16, pads=(0, 70, 0))
    runs = {}
    for kernels in ("cpu", "reference"):
        store = FakeStore()
        runs[kernels] = (d.run(store, kernels=kernels, index=index, budget=0.125, micro_batch=2), fetched(store))
    (cpu, cpu_fetched), (ref, ref_fetched) = runs["cpu"], runs["reference"]
    torch.testing.assert_close(cpu.outs, ref.outs, atol=1e-5, rtol=1e-5)
    for key in ("hits", "misses", "bytes_fetched", "attended_tokens"):
        assert cpu.stats[key] == ref.stats[key], key
    assert cpu.stats["misses"] > 0
    # The same pages, not only as many (uids differ between the stores: compare by row order).
    assert sorted(Counter({k[1:]: v for k, v in cpu_fetched.items()}).items()) == \
        sorted(Counter({k[1:]: v for k, v in ref_fetched.items()}).items())


@pytest.mark.parametrize("land", ["submit", "wait"])
def test_pipelined_fetches_use_their_own_staging_buffers(land):
    # "submit": blocks land at get_async, so a staging buffer reused before its data is read
    # would hand a micro-batch another one's pages; "wait": they land only at wait(), so a read
    # before the wait would see stale bytes. Either way the pipeline must match serial decode.
    d = Decode(B=4, T=320, steps=12, pads=(0, 70, 0, 5))
    serial = d.run(FakeStore(land=land), budget=0.125, pipeline=False)
    store = FakeStore(land=land)
    piped = d.run(store, budget=0.125, pipeline=True, micro_batch=1)
    torch.testing.assert_close(piped.outs, serial.outs, atol=1e-6, rtol=1e-6)
    for key in ("hits", "misses", "bytes_fetched"):
        assert piped.stats[key] == serial.stats[key], key
    # Two staging buffers for the gets, after the prefill's two put buffers (freed when it ends).
    assert store.counts["register"] == 4 and store.counts["unregister"] >= 2 and piped.stats["misses"] > 0


@pytest.mark.parametrize("keep", [False, True])
def test_the_store_is_used_from_the_calling_thread_and_released_at_close(keep):
    d = Decode(B=3, T=200, steps=20, pads=(0, 9, 0))
    store = FakeStore()
    d.run(store, budget=0.125, pipeline=True, micro_batch=1, keep=keep)
    me = threading.get_ident()
    assert store.get_log and {r.thread for r in store.get_log} == {me}
    assert {r.thread for r in store.put_log} == {me}
    assert store.unwaited == 0  # every get was waited for
    assert store.registered == 0 and store.counts["register"] == store.counts["unregister"]
    assert len(store.names()) == (3 if keep else 0)


def test_a_restored_prefix_decodes_like_the_prefill_that_stored_it():
    d = Decode(B=2, T=200, steps=30)
    names, prefix = ["prefix-a", "prefix-b"], 8
    store = FakeStore()
    opts = dict(budget=0.25, index="meankey", pipeline=False)  # an index that does not fit itself to the queries
    first = d.run(store, restore=(names, prefix), **opts)
    assert not first.restored
    # Pages below the prefix went to the kept sequences, once; the session's own are gone.
    assert store.names() == names
    for row, name in enumerate(names):
        seq = store.open("kvdrive", name)
        assert seq.complete_pages == prefix and seq.num_blocks == prefix * L * H
        assert all(data == d.block(layer, row, h, p) for (layer, h, p), data in store.sequence_blocks(seq).items())
    since = store.now()
    second = d.run(store, restore=(names, prefix), **opts)
    assert second.restored and second.stats["restored_pages"] == prefix * 2
    torch.testing.assert_close(second.outs, first.outs, atol=1e-6, rtol=1e-6)
    assert second.stats["misses"] == first.stats["misses"] and second.stats["hits"] == first.stats["hits"]
    later = [r for r in store.put_log if r.event > since]
    assert later and all(min(r.pages) >= prefix for r in later)  # the prefix is not stored again
    prefix_uids = {store.uid_of("kvdrive", n) for n in names}
    assert {u for (u, _, _, _) in fetched(store, since)} & prefix_uids  # it is read from the kept sequences


# ---------------------------------------------------------------- what is attended


def test_sink_pages_are_always_attended_from_slots_holding_their_bytes(monkeypatch):
    # A small cache (cache_multiplier 1) and a low budget: pages are evicted all the time; two sink pages.
    d = Decode(B=3, T=320, steps=24, pads=(0, 40, 0))
    keys = [d.kv(layer) for layer in range(L)]
    seen = Counter()
    finish = attention.finish

    def checked(ctx, io, plan, layer, mb, landed=None):
        out = finish(ctx, io, plan, layer, mb, landed)
        sink = plan.sink
        assert sink == 2
        # A row's sink is its first pages from its first real token on (row 1: 40 padding tokens, page 2).
        first = torch.tensor([d.pads[mb.lo + b] // S for b in range(mb.rows)])
        assert (mb.chosen[:, :, :sink] == (first[:, None] + torch.arange(sink))[:, None, :]).all()
        slots = mb.placement.slots
        attended = mb.chosen >= 0
        # Every attended page sits in the slot it is read from, and that slot holds its K and V.
        held = mb.cache.slot_page.gather(2, slots.clamp_min(0))
        assert (held[attended] == mb.chosen[attended]).all()
        k_all, v_all = keys[layer]
        for b, h, i in torch.nonzero(attended).tolist():
            page, slot, row = int(mb.chosen[b, h, i]), int(slots[b, h, i]), mb.lo + b
            at = slice(page * S, (page + 1) * S)
            assert torch.equal(mb.cache.k[b, h, slot], k_all[row, h, at]), (layer, row, h, page)
            assert torch.equal(mb.cache.v[b, h, slot], v_all[row, h, at]), (layer, row, h, page)
        # The sink tokens count as real ones (a padded row's first sink page holds some padding).
        for b in range(mb.rows):
            pad_in_page = d.pads[mb.lo + b] % S
            assert mb.valid[b, :, pad_in_page : sink * S].all()
            assert not mb.valid[b, :, :pad_in_page].any()
        seen["checked"] += 1
        return out

    monkeypatch.setattr(attention, "finish", checked)
    res = d.run(FakeStore(), budget=0.0625, cache_multiplier=1, sink_tokens=32, micro_batch=2, pipeline=True)
    assert seen["checked"] == 24 * L * 2  # every step, layer and micro-batch
    assert res.stats["misses"] > 0


@pytest.mark.parametrize("pad", [37, 64])
def test_a_left_padded_row_attends_none_of_its_padding(pad):
    # Every page attended (budget 1.0): the padded row's output is that of the row alone.
    d = Decode(B=2, T=260, steps=20, pads=(0, pad))
    batch = d.run(FakeStore(), budget=1.0, micro_batch=1)
    alone = d.row(1).run(FakeStore(), budget=1.0)
    torch.testing.assert_close(batch.outs[:, :, 1], alone.outs[:, :, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("index", ["oracle", "meankey", "quest"])
def test_a_left_padded_row_selects_like_the_row_alone(index):
    # A whole number of padding pages keeps the pages aligned; with a per-row index, a fixed
    # token budget and no sink, the padded row selects the same real pages as the row alone:
    # padding pages are never chosen, so they take no slot of its budget.
    d = Decode(B=2, T=256, steps=20, pads=(0, 64))
    opts = dict(index=index, budget_tokens=48, sink_tokens=0, pipeline=False)
    batch = d.run(FakeStore(), **opts)
    alone = d.row(1).run(FakeStore(), **opts)
    torch.testing.assert_close(batch.outs[:, :, 1], alone.outs[:, :, 0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("index", ["lowrank", "meankey", "quest", "oracle"])
def test_a_left_padded_row_decodes_like_the_row_alone_at_a_sparse_budget(index):
    # Padding that is no whole number of pages, rows of three lengths: each row's pages, its k
    # (1, 3 and 2 pages of 6.25%) and its index fit are its own, as when it runs alone.
    d = Decode(B=3, T=600, steps=24, pads=(480, 0, 250))
    opts = dict(index=index, budget=0.0625, pipeline=True, micro_batch=2)
    batch = d.run(FakeStore(), **opts)
    assert batch.stats["attended_tokens"] < 0.5 * batch.stats["context_tokens"]
    for row in range(3):
        alone = d.row(row).run(FakeStore(), **opts)
        torch.testing.assert_close(batch.outs[:, :, row], alone.outs[:, :, 0], atol=1e-6, rtol=1e-6)


def test_a_left_padded_row_keeps_its_first_real_tokens_as_sink():
    d = Decode(B=2, T=256, steps=20, pads=(0, 64))
    opts = dict(index="oracle", budget_tokens=48, sink_tokens=16, pipeline=False)
    batch = d.run(FakeStore(), **opts)
    alone = d.row(1).run(FakeStore(), **opts)
    torch.testing.assert_close(batch.outs[:, :, 1], alone.outs[:, :, 0], atol=1e-6, rtol=1e-6)


def _dense(q, k, v, valid):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", q, k) * D**-0.5
    return torch.einsum("bht,bhtd->bhd", torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), -1), v)


@pytest.mark.parametrize("index", ["lowrank", "hierarchical", "meankey", "quest"])
def test_a_prompt_shorter_than_a_page_decodes_exactly_at_full_budget(index):
    # Page 0: 11 tokens of KVDrive's padding and the 5 of the prompt; pages 1 and 2 complete while decoding.
    d = Decode(B=1, T=5, steps=40)
    store = FakeStore()
    res = d.run(store, budget=1.0, local_tokens=16, sink_tokens=16, index=index, pipeline=False, keep=True)
    for layer in range(L):
        k, v = d.kv(layer)
        for step in range(40):
            t = 5 + step + 1
            q = d.steps[step][layer][0]
            want = _dense(q, k[:, :, :t], v[:, :, :t], torch.ones(1, t, dtype=torch.bool))
            torch.testing.assert_close(res.outs[step, layer], want, atol=1e-5, rtol=1e-5)
    assert set(store.sequence_blocks(seq_of(store, 0))) == {(layer, h, p) for layer in range(L) for h in range(H)
                                                            for p in (0, 1, 2)}
    assert res.stats["misses"] > 0  # page 0 was fetched after it left the local window


# ---------------------------------------------------------------- FakeStore against kvstored


def test_fake_store_decodes_like_the_real_daemon(daemon):
    d = Decode(B=3, T=320, steps=16, pads=(0, 70, 0))
    opts = dict(budget=0.125, micro_batch=2)
    fake = FakeStore()
    on_fake = d.run(fake, **opts)
    with daemon.client() as store:
        before = store.stats()["counters"]
        on_real = d.run(store, **opts)
        after = store.stats()["counters"]
    assert torch.equal(on_fake.outs, on_real.outs)
    for key in ("hits", "misses", "bytes_fetched", "bytes_put", "pages_flushed", "attended_tokens"):
        assert on_fake.stats[key] == on_real.stats[key], key
    assert on_fake.stats["misses"] > 0
    real_blocks = sum(after.get(k, 0) - before.get(k, 0) for k in ("blocks_dram", "blocks_ssd"))
    assert fake.counts["blocks_fetched"] == real_blocks
    assert fake.counts["get"] == after["gets"] - before.get("gets", 0)


@pytest.mark.parametrize("kind", ["fake", "real"])
def test_fake_store_refuses_what_the_daemon_refuses(kind, request):
    if kind == "fake":
        store = FakeStore()
    else:
        store = request.getfixturevalue("daemon").client()
    geometry = SHAPE.geometry(S)
    bb = geometry.block_bytes
    try:
        with pytest.raises(NotFoundError):
            store.open("kvdrive", "never-created")
        seq = store.create("kvdrive", "refusals", geometry)
        with pytest.raises(ExistsError):
            store.create("kvdrive", "refusals", geometry)
        assert store.create("kvdrive", "refusals", geometry, exist_ok=True).uid == seq.uid
        data = np.arange(L * H * 2 * bb, dtype=np.int64).astype(np.uint8).reshape(L, H, 2, bb)
        store.put(seq, range(L), [0, 1], data)
        with pytest.raises(ExistsError):  # blocks are write-once
            store.put(seq, [0], [1], data[:1, :, :1])
        assert store.open("kvdrive", "refusals").complete_pages == 2
        buf = store.register(4 * bb)
        # A get of a page never put fails at wait(), and copies nothing.
        buf.array[:] = 7
        pending = store.get_async(seq, [[0, 0, 0], [1, 1, 5]], buf)
        with pytest.raises(NotFoundError, match="not stored"):
            pending.wait()
        assert (buf.array == 7).all()
        reply = store.get_async(seq, [[1, 1, 1], [0, 0, 0]], buf).wait()
        assert reply["dram"] + reply["ssd"] == 2
        assert buf.array[:bb].tobytes() == data[1, 1, 1].tobytes()
        assert buf.array[bb : 2 * bb].tobytes() == data[0, 0, 0].tobytes()
        store.unregister(buf)
        store.delete("kvdrive", "refusals")
        with pytest.raises(NotFoundError):
            store.open("kvdrive", "refusals")
    finally:
        store.close()
