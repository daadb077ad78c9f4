"""``kvdrive-bench fidelity``'s options and defaults, apart from the benchmark so that
``--help`` answers without importing torch or a model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvdrive.tools.cli_paths import output_file
from kvdrive.tools.copytext import KINDS as COPY_KINDS
from kvdrive.tools.targets import DENSE_TARGETS, DenseTarget
from kvdrive_client.index_kind import IndexKind

PREFILL_CHUNK = 8192
DEFAULT_TOKENS, QUICK_TOKENS = 64, 16
DEFAULT_BUDGETS, QUICK_BUDGETS = (0.0625, 0.03125), (0.0625,)
SELECTORS = (IndexKind.ORACLE, IndexKind.LOWRANK, IndexKind.HIERARCHICAL, IndexKind.MEAN_KEY, IndexKind.QUEST)
DEFAULT_WINDOWS, QUICK_WINDOWS = 3, 1


@dataclass(frozen=True)
class ModelRun:
    """Per model: its default contexts, and its targets against dense attention."""

    contexts: tuple[int, ...]
    quick_contexts: tuple[int, ...]
    target: DenseTarget


MODEL_RUNS = {
    "smollm2": ModelRun((2048, 7168), (2048,), DENSE_TARGETS["smollm2"]),
    # 32K: the model's 32768 positions less room for the decoded tokens, in whole pages.
    "gemma3-270m": ModelRun((16384, 32640), (4096,), DENSE_TARGETS["gemma3-270m"]),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: one short context (see --context), {QUICK_TOKENS} decode tokens, budget 6.25%% "
                        f"only, {QUICK_WINDOWS} text window")
    p.add_argument("--model", default="smollm2", choices=list(MODEL_RUNS),
                   help="the real model to decode (default smollm2); gemma3-270m: only its global layers go through KVDrive")
    p.add_argument("--context", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="context length(s) (default "
                        + "; ".join(f"{n}: {' '.join(map(str, m.contexts))}, {' '.join(map(str, m.quick_contexts))} "
                                    f"with --quick" for n, m in MODEL_RUNS.items()) + ")")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="TOKENS",
                   help=f"contexts longer than this are prefilled densely in chunks of it (default {PREFILL_CHUNK})")
    p.add_argument("--windows", type=int, default=None,
                   help=f"text windows: the first at the text's start (tuning), the others held out, spread to its end "
                        f"(default {DEFAULT_WINDOWS}, {QUICK_WINDOWS} with --quick)")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"teacher-forced decode tokens (default {DEFAULT_TOKENS}, {QUICK_TOKENS} with --quick)")
    p.add_argument("--budget", type=float, nargs="+", default=None, metavar="FRACTION",
                   help="budgets, fractions of the selectable pages (default 0.0625 0.03125, 0.0625 with --quick)")
    p.add_argument("--selectors", nargs="+", default=[k.value for k in SELECTORS], choices=[k.value for k in IndexKind],
                   help=f"default: {' '.join(k.value for k in SELECTORS)}; keycodes (every key in 4-bit codes, three "
                        f"times lowrank's bytes) only when named")
    p.add_argument("--rank", type=int, default=None,
                   help="lowrank: the sketch rank (default: attach()'s, 27/64 of the head dim)")
    p.add_argument("--int8-channels", type=int, default=None, metavar="N",
                   help="lowrank: the sketch's leading channels kept int8 (default: attach()'s, head dim / 64)")
    p.add_argument("--int2-channels", type=int, default=None, metavar="N",
                   help="lowrank: the sketch's trailing channels kept int2, the others int4 (default: attach()'s, "
                        "12/64 of the head dim (13/64 from 256 on), or none with --rank)")
    p.add_argument("--text", type=Path, default=None, metavar="FILE",
                   help="UTF-8 text to read instead of the common licenses")
    p.add_argument("--corpus", nargs="?", const="", default=None, metavar="DIR",
                   help="windows from each kind of text of the built-in corpus (code, reference documentation, "
                        "tables, logs, changelogs found on this machine), or of DIR (each file or subdirectory a "
                        "kind), instead of the licences; adds the worst window beside the mean")
    p.add_argument("--copy", nargs="*", default=None, metavar="KIND",
                   help=f"generated texts whose decode copies spans from far back, --windows seeds of each kind "
                        f"({', '.join(COPY_KINDS)}; none named: all), instead of the licences; the report adds the "
                        f"worst window and the share of copied tokens whose greedy token is dense's")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; selection kernels take microseconds per layer and extra threads on "
                        "a shared machine mostly add noise to select_ms (0: torch's own default)")
    p.add_argument("--json", type=output_file, default=None, metavar="FILE",
                   help='also write {"fidelity": [rows], "cache": [rows]} as JSON')
