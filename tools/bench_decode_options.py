"""``kvdrive-bench decode``'s options, apart from the benchmark so that ``--help`` answers
without importing torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdrive.tools.cli_paths import output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a short run: (a) at 1K tokens, (b) 2 layers x 4K tokens, few steps")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=None, help="which of a,b,c to run (default all)")
    p.add_argument("--configs", type=lambda s: s.split(","), default=None,
                   help="run only these configurations, comma-separated (default all; names as in the table)")
    p.add_argument("--context-a", type=int, default=None, help="workload a's context in tokens (default 7168, 1024 quick)")
    p.add_argument("--steps-a", type=int, default=None, help="workload a's decode steps, warm-up included (default 24)")
    p.add_argument("--batches-a", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="workload a's batch sizes (default 1,4)")
    p.add_argument("--layers-b", type=int, default=None, help="workload b/c layers (default 8, 2 quick)")
    p.add_argument("--context-b", type=int, default=None, help="workload b/c context in tokens (default 32768, 4096 quick)")
    p.add_argument("--steps-b", type=int, default=None, help="workload b/c measured decode steps after warm-up (default 12)")
    p.add_argument("--text", type=Path, default=None, help="text for workload a (default: the bundled license texts)")
    p.add_argument("--seed", type=int, default=None, help="seed of the synthetic workload (default 0)")
    p.add_argument("--device", default=None,
                   help="workloads b and c on this torch device, e.g. cuda (dense-in-HBM is then the dense row; "
                        "default cpu)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE", help="also write one row per workload x config x tier")
    p.add_argument("--png", type=output_file, default=None, metavar="FILE",
                   help="also draw tokens/s per configuration (matplotlib)")
