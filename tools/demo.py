"""The main job: an embedded kvstored and a store round trip of a model-shaped KV cache."""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvdrive_client import Geometry, connect


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdrive.tools.demo", description=__doc__)
    p.add_argument("--dram", default="32M", help="DRAM tier of the embedded daemon")
    p.add_argument("--tokens", type=int, default=4096, help="prompt length stored")
    args = p.parse_args(argv)
    # SmolLM2-135M's KV shape: 30 layers, 3 KV heads, head dim 64, fp16.
    geom = Geometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", page_size=16)
    pages = args.tokens // geom.page_size
    rng = np.random.default_rng(0)
    with connect(None, dram=args.dram) as store:
        info = store.server_info
        print(f"embedded kvstored pid {info['pid']}: engine {info['engine']}, DRAM {info['dram_bytes'] >> 20} MiB")
        seq = store.create("demo", "prompt", geom)
        kv = rng.standard_normal((geom.num_layers, geom.num_kv_heads, pages, geom.block_bytes // 2)).astype(np.float16)
        t = time.perf_counter()
        for layer in range(geom.num_layers):  # one layer at a time, as prefill produces them
            store.put(seq, [layer], range(pages), kv[layer : layer + 1], cluster=rng.integers(0, 16, (1, geom.num_kv_heads, pages)))
        put_s = time.perf_counter() - t
        total = kv.nbytes
        print(f"stored {args.tokens} tokens x {geom.num_layers} layers: {total / 2**20:.1f} MiB in {put_s:.2f} s (durable)")
        n = max(1, len(kv.reshape(-1, geom.block_bytes // 2)) // 16)
        flat = np.stack(np.unravel_index(rng.choice(geom.num_layers * geom.num_kv_heads * pages, n, replace=False),
                                         (geom.num_layers, geom.num_kv_heads, pages)), axis=1)
        t = time.perf_counter()
        out = store.get(seq, flat)
        get_ms = (time.perf_counter() - t) * 1e3
        expect = kv[flat[:, 0], flat[:, 1], flat[:, 2]].view(np.uint8)
        ok = np.array_equal(out, expect)
        counters = store.stats()["counters"]
        print(f"sparse get of {n} blocks (6.25%): {get_ms:.1f} ms, {counters.get('blocks_dram', 0)} from DRAM, "
              f"{counters.get('blocks_ssd', 0)} from SSD in {counters.get('ssd_reads', 0)} reads; bit-exact: {ok}")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
