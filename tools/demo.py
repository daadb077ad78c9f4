"""The main job: SmolLM2-135M answering over real text, its KV cache served by an embedded kvstored."""

from __future__ import annotations

import argparse
import logging
import time

import torch

from kvdrive_client import attach, connect
from kvdrive_client.models import LICENSE_DIR, load_smollm2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdrive.tools.demo", description=__doc__)
    p.add_argument("--dram", default="32M", help="DRAM tier of the embedded daemon (small, so some blocks come from SSD)")
    p.add_argument("--budget", type=float, default=0.0625, help="fraction of the context attended per decode step")
    p.add_argument("--document", default=str(LICENSE_DIR / "GPL-3"), help="text the question is asked about")
    p.add_argument("--question", default="Which license is this document, and who published it?")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    print("loading SmolLM2-135M-Instruct (offline GGUF) ...", flush=True)
    model, tok = load_smollm2()
    document = open(args.document, encoding="utf-8", errors="replace").read()
    messages = [{"role": "user", "content": f"{document}\n\n{args.question}"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = ids["input_ids"].shape[1]

    with connect(None, dram=args.dram) as store:
        info = store.server_info
        print(f"embedded kvstored pid {info['pid']}: DRAM tier {info['dram_bytes'] >> 20} MiB, SSD engine {info['engine']}")
        handle = attach(model, store, budget=args.budget)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        elapsed = time.perf_counter() - t
        stats = handle.stats()
        handle.detach()
    answer = tok.decode(out[0, prompt_len:], skip_special_tokens=True)
    print(f"\nprompt: {prompt_len} tokens ({args.document}) + question: {args.question}")
    print(f"answer: {answer.strip()}\n")
    steps = stats.get("steps", 0)
    print(f"generated {out.shape[1] - prompt_len} tokens in {elapsed:.1f} s through KVDrive (budget {args.budget:.2%})")
    print(f"  attended per step: {stats.get('attended_fraction', 0):.1%} of the context")
    print(f"  device-cache hit rate: {stats['hit_rate']:.1%} ({stats.get('hits', 0)} hits, {stats.get('misses', 0)} misses)")
    print(f"  fetched: {stats['bytes_from_dram'] / 2**20:.2f} MiB from DRAM, {stats['bytes_from_ssd'] / 2**20:.2f} MiB from SSD")
    print(f"  stored at prefill: {stats.get('bytes_put', 0) / 2**20:.1f} MiB; index {stats.get('index_bytes', 0) / 2**10:.0f} KiB")
    if steps:
        for key in ("select_ms", "fetch_ms", "attention_ms"):
            print(f"  {key[:-3]} per step: {stats.get(key, 0) / steps:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
