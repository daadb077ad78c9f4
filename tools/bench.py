"""``kvdrive-bench``: KVDrive's benchmarks, one subcommand each.

Every benchmark lives in a sibling module ``bench_<name>.py`` that provides

- ``add_arguments(parser)``: its options, on the subcommand's parser;
- ``run(args) -> int``: the measurement; it prints one table and returns the exit code.

A benchmark whose module imports torch keeps its options in ``bench_<name>_options.py``
(:attr:`Benchmark.options`), so that ``--help`` answers in a fraction of a second.

:data:`BENCHMARKS` names them. A module is imported only when its subcommand is
chosen, so a benchmark with heavy dependencies (a model, torch) costs nothing to the
others. Adding one (``fidelity``, ``decode``) is a new module and one line here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

from kvdrive.protocol.release import add_version_option


@dataclass(frozen=True)
class Benchmark:
    module: str
    summary: str
    options: str | None = None  # the module of add_arguments(), when not ``module``

    def load(self) -> ModuleType:
        return importlib.import_module(f"kvdrive.tools.{self.module}")

    def load_options(self) -> ModuleType:
        return importlib.import_module(f"kvdrive.tools.{self.options or self.module}")


BENCHMARKS: dict[str, Benchmark] = {
    "store": Benchmark(
        "bench_store",
        "kvstored's data path: DRAM-tier sparse get vs memcpy, SSD-tier packed vs token-order vs sequential, "
        "single-block round trips",
    ),
    "fidelity": Benchmark(
        "bench_fidelity",
        "sparse decode vs dense on SmolLM2 per selector (recall, loss, KL, index size, selection time), "
        "and eviction policies replayed on the selection trace",
        options="bench_fidelity_options",
    ),
    "decode": Benchmark(
        "bench_decode",
        "end-to-end decode tokens/s of KVDrive against dense, whole-layer fetch, Quest-style and ShadowKV-style "
        "configurations, on SmolLM2 and an attention-only Llama-3-8B-shaped workload, DRAM and DRAM+SSD tiers",
        options="bench_decode_options",
    ),
    "prefill": Benchmark(
        "bench_prefill",
        "a prompt's prefill through KVDrive beside plain transformers', side by side, and where KVDrive's extra "
        "time goes (index build, importance, store puts, cache seed)",
    ),
    "tier": Benchmark(
        "bench_tier",
        "the vLLM and SGLang adapters storing and loading Llama-3-8B-shaped blocks through kvstored's DRAM and SSD "
        "tiers (durable and write-behind), beside the engines' own backends (vLLM's fs tier, SGLang's file backend), "
        "a memcpy and the disk's sequential read and durable write; a load's latency alone and during stores; store "
        "throughput as ten times the DRAM tier fills",
    ),
    "soak": Benchmark(
        "bench_soak",
        "kvstored under a long run of engine traffic (stores evicting past a quota, loads beside them): latency, "
        "hit rate, wrong bytes and the daemon's memory, mappings, descriptors and files, interval by interval",
    ),
    "scale": Benchmark(
        "bench_scale",
        "kvstored's memory per stored block (its own, and the catalog pages it maps) as a store of small engine "
        "blocks grows, its start-up time per block after a SIGKILL, and kvstore-inspect's time and memory on it",
    ),
    "flood": Benchmark(
        "bench_flood",
        "a well-behaved client's put-ack latency (p50, p99) at rest and while another floods kvstored with "
        "connections, lists, 4 MiB puts and SSD-tier gets, and whether the daemon survives each flood",
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds an option's default to its help unless the help already tells it or there is none to tell."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` benchmark's module is imported for its options."""
    p = argparse.ArgumentParser(prog="kvdrive-bench", description="KVDrive benchmarks. Each prints one table from one run.")
    add_version_option(p)
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, bench in BENCHMARKS.items():
        sp = sub.add_parser(name, help=bench.summary, description=bench.summary,
                            formatter_class=HelpFormatter)
        if name == selected:
            bench.load_options().add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top-level parser has no options of its own: the first word is the subcommand.
    selected = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(selected if selected in BENCHMARKS else None).parse_args(argv)
    return BENCHMARKS[args.bench].load().run(args)


if __name__ == "__main__":
    raise SystemExit(main())
