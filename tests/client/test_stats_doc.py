"""docs/stats.md lists every key a real decode and a real daemon report, and no key that none reports."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvdrive_client import attach, connect

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "stats.md"


def documented() -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)` \|", DOC.read_text(), re.MULTILINE))


def real_stats(model) -> tuple[dict, dict]:
    """Handle.stats() and StoreClient.stats() after decoding that counts every common figure: misses
    served from DRAM and SSD (a DRAM tier smaller than the KV), pages completed while decoding, a
    prompt reused from the store."""
    # 600 tokens: a reused prompt runs its last 512 through the model (the index fits their queries).
    ids = torch.randint(0, model.config.vocab_size, (1, 600), generator=torch.Generator().manual_seed(0))
    with connect(None, dram="64K", ssd_max="64M") as store:
        handle = attach(model, store, budget=0.25, cache_multiplier=1, reuse=True)
        try:
            with torch.no_grad():
                for _ in range(2):  # the second one reuses the first one's prompt pages
                    model.generate(input_ids=ids, max_new_tokens=20, do_sample=False)
            return handle.stats(), store.stats()
        finally:
            handle.detach()


def test_every_reported_key_is_documented(make_tiny):
    session, daemon = real_stats(make_tiny("llama"))
    assert session["misses"] and session["blocks_ssd"] and session["restored_pages"] and session["pages_flushed"]
    reported = set(session) | set(session["store"]) | set(daemon) | set(daemon["counters"])
    missing = reported - documented()
    assert not missing, f"docs/stats.md does not document {sorted(missing)}: add them with their unit and meaning"


def test_every_documented_key_is_counted_somewhere():
    sources = "".join(p.read_text() for d in ("client", "kvstored") for p in (ROOT / d).rglob("*.py"))
    envelope = {"v", "id", "ok"}  # every reply's, written by kvdrive.protocol
    stale = {k for k in documented() - envelope if f'"{k}"' not in sources}
    assert not stale, f"docs/stats.md documents {sorted(stale)}, which nothing reports any more"
