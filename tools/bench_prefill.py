"""``kvdrive-bench prefill``: a prompt's prefill through KVDrive beside plain transformers'.

One process, one model, one prompt. Each round runs the model's prefill of the prompt
twice, in turn (the order alternates from round to round, so a slow spell of the
shared machine falls on both): once into transformers' own ``DynamicCache``, once into
a ``KVDriveCache`` of an attached handle against a kvstored (embedded, with the demo's
small DRAM tier by default). Both are the call ``generate()`` makes for its prefill:
the whole prompt in one forward pass, logits of the last position only. The table
gives both times, their ratio, and where KVDrive's extra time goes, from the session's
own counters: the index build, the importance scores, the main thread's share of the
store puts (copying a layer's pages into a put buffer, and waiting for a put buffer the
daemon has not released yet), and the device cache with its seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvdrive.tools.cli_paths import output_file
from kvdrive.tools.text_table import text_table

# The parts of a KVDrive prefill that are not the model's own work (session counters, ms).
PARTS = (
    ("index", "prefill_index_ms"),
    ("importance", "prefill_importance_ms"),
    ("puts", "prefill_put_ms"),
    ("cache", "prefill_cache_ms"),
)
QUICK_CONTEXT = 2048


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=7168, help="prompt tokens (SmolLM2 holds 8192)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each one prefill of either kind")
    p.add_argument("--dram", default="32M", help="DRAM tier of the embedded kvstored (the demo's)")
    p.add_argument("--store", default=None, metavar="ADDR", help="a running kvstored instead of an embedded one")
    p.add_argument("--budget", type=float, default=0.0625, help="decode budget of the attached handle")
    p.add_argument("--index", default="lowrank", help="index the handle builds at prefill")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_CONTEXT} tokens, 2 rounds")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write the rows as JSON")


def _prompt(tok, n: int):
    from kvdrive.tools.bench_common import InputError
    from kvdrive_client.models import license_text

    ids = tok(license_text(), return_tensors="pt").input_ids
    if ids.shape[1] < n:
        raise InputError(f"the license texts hold {ids.shape[1]} tokens; --context {n} is more")
    return ids[:, :n]


def _prefill(model, ids, cache) -> float:
    import torch

    mask = torch.ones_like(ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


def _kvdrive_round(model, handle, ids) -> tuple[float, dict]:
    cache = handle.new_cache(ids.shape[0])
    try:
        before = dict(cache.session.stats)  # the handle's counters, shared by its sessions
        seconds = _prefill(model, ids, cache)
        stats = {k: v - before.get(k, 0) for k, v in cache.session.stats.items()}
    finally:
        cache.close()
    return seconds, {name: stats.get(key, 0.0) / 1e3 for name, key in PARTS} | {
        "put_wait": stats.get("prefill_put_wait_ms", 0.0) / 1e3}


def measure(model, tok, store, args) -> list[dict]:
    from transformers import DynamicCache

    from kvdrive_client import attach

    context, rounds = (QUICK_CONTEXT, 2) if args.quick else (args.context, args.rounds)
    ids = _prompt(tok, context)
    handle = attach(model, store, budget=args.budget, index=args.index)
    try:
        print(f"prefill: warming up (one prefill of each kind at {min(context, 1024)} tokens)", flush=True)
        _prefill(model, ids[:, :1024], DynamicCache(config=model.config))
        _kvdrive_round(model, handle, ids[:, :1024])
        rows = []
        for r in range(rounds):
            order = ("dense", "kvdrive") if r % 2 == 0 else ("kvdrive", "dense")
            row = {"round": r, "tokens": context}
            for kind in order:
                if kind == "dense":
                    row["dense_s"] = _prefill(model, ids, DynamicCache(config=model.config))
                else:
                    row["kvdrive_s"], parts = _kvdrive_round(model, handle, ids)
                    row.update({f"{k}_s": v for k, v in parts.items()})
            row["ratio"] = row["kvdrive_s"] / row["dense_s"]
            row["model_s"] = row["kvdrive_s"] - sum(row[f"{name}_s"] for name, _ in PARTS)
            print(f"prefill: round {r + 1}/{rounds}: dense {row['dense_s']:.2f} s, KVDrive {row['kvdrive_s']:.2f} s "
                  f"({row['ratio']:.3f}x)", flush=True)
            rows.append(row)
    finally:
        handle.detach()
    return rows


def report(rows: list[dict], dram: str) -> list[str]:
    cols = ("dense_s", "kvdrive_s", "ratio", "model_s", *(f"{n}_s" for n, _ in PARTS), "put_wait_s")
    head = ("round", "dense s", "KVDrive s", "ratio", "model", *(n for n, _ in PARTS), "put wait")
    body = [(str(r["round"] + 1), *(f"{r[c]:.3f}" if c == "ratio" else f"{r[c]:.2f}" for c in cols)) for r in rows]
    med = {c: statistics.median(r[c] for r in rows) for c in cols}
    body.append(("median", *(f"{med[c]:.3f}" if c == "ratio" else f"{med[c]:.2f}" for c in cols)))
    tokens = rows[0]["tokens"]
    lines = [f"prefill of {tokens} tokens, SmolLM2-135M, DRAM tier {dram}: plain transformers (DynamicCache) "
             f"vs KVDrive, side by side", *text_table(head, body)]
    lines.append(f"KVDrive's prefill takes {med['ratio']:.3f}x plain transformers' (median of {len(rows)} rounds; "
                 f"best {min(r['ratio'] for r in rows):.3f}x, worst {max(r['ratio'] for r in rows):.3f}x)")
    lines.append("model: the model's own work in KVDrive's prefill (the rest of its time); puts: the main thread's "
                 "share of the store puts, of which 'put wait' is waiting for the daemon")
    return lines


def run(args: argparse.Namespace) -> int:
    from kvdrive.tools.bench_common import InputError
    from kvdrive_client import connect
    from kvdrive_client.models import load_smollm2

    if args.context < 1024 or args.rounds < 1:
        raise InputError("--context must be at least 1024 and --rounds at least 1")
    print("prefill: loading SmolLM2-135M", flush=True)
    model, tok = load_smollm2()
    with (connect(args.store) if args.store else connect(None, dram=args.dram)) as store:
        rows = measure(model, tok, store, args)
    for line in report(rows, args.dram if not args.store else args.store):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"prefill": rows}, indent=1))
    return 0
