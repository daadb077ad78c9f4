"""``kvdrive-profile``: a device-cache window per (layer, KV head) for a total cache budget.

A real model (``--model``: SmolLM2-135M by default, or Gemma 3 270M, whose global
layers alone are decoded by KVDrive and profiled; float32) reads ``--sequences``
consecutive windows of calibration text
(the Debian common licenses, or ``--text FILE``), ``--context`` tokens each, as one
batch through KVDrive (:func:`attach` with a private embedded kvstored), then decodes
the next ``--steps`` tokens of each teacher-forced. The pages the selector picks at
every step, layer and KV head are recorded and replayed through the device cache
(``LOOKAHEAD`` eviction, as decode evicts) at every window of ``--windows``, each
replay starting from the prefill's seeding as a session does. Then one window per
(layer, KV head) is chosen so that the pages fetched per step are fewest within
``--cache-bytes`` (:func:`kvdrive_client.profile.solve_windows`), with each sequence
held out in turn to decide how far per-head curves are trusted, and written to
``--out`` as JSON (:class:`kvdrive_client.profile.WindowProfile`).

It prints the chosen windows per layer and the predicted bytes fetched per step,
for the profile and for the best single window at the same cache bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvdrive.protocol.release import add_version_option
from kvdrive.tools.text_table import text_table
from kvdrive_client.models import MODELS
from kvdrive_client.profile import DEFAULT_CHOICES, UNIFORM_WINDOW, WindowProfile, capacity_pages

if TYPE_CHECKING:
    from kvdrive_client.config import AttachConfig

# torch, transformers, the SDK's decode path (AttachConfig, bench_common) and kvstored.config
# (numba) take seconds to import: they are imported where a run needs them, so that --help
# answers at once.

PROG = "kvdrive-profile"
DEFAULT_CONTEXT, QUICK_CONTEXT = 2048, 512
DEFAULT_STEPS, QUICK_STEPS = 32, 8
DEFAULT_SEQUENCES = 2
WARMUP_STEPS = 0  # the replay starts from the prefill seeding, as the session does: every step counts
MIN_STEPS = 2
MIN_SELECTABLE_PAGES = 16
DRAM = "1G"
# AttachConfig's budget and page_size, for --help (tests/tools/test_cli_help.py checks they agree).
DEFAULT_BUDGET, DEFAULT_PAGE_SIZE = 0.0625, 16


@dataclass(frozen=True)
class ProfileRun:
    context: int
    steps: int
    sequences: int
    budget: float
    page_size: int
    choices: tuple[float, ...]
    cache_bytes: int | None
    text: Path | None
    out: Path
    model: str = "smollm2"

    def __post_init__(self) -> None:
        from kvdrive.tools.bench_common import InputError  # noqa: PLC0415

        if self.model not in MODELS:
            raise InputError(f"--model {self.model!r}: choose one of {', '.join(MODELS)}")
        attach_cfg = self.attach_config()  # budget and page size are checked there
        least = attach_cfg.sink_tokens + attach_cfg.local_tokens + MIN_SELECTABLE_PAGES * self.page_size
        if self.context < least:
            raise InputError(f"--context must be at least {least} tokens (sink {attach_cfg.sink_tokens} + local "
                             f"window {attach_cfg.local_tokens} + {MIN_SELECTABLE_PAGES} selectable pages of "
                             f"{self.page_size}), got {self.context}")
        if self.steps < MIN_STEPS:
            raise InputError(f"--steps must be at least {MIN_STEPS}, got {self.steps}")
        if self.sequences < 1:
            raise InputError(f"--sequences must be at least 1, got {self.sequences}")
        if not self.choices or min(self.choices) < 1:
            raise InputError(f"--windows must be >= 1, got {list(self.choices)}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise InputError(f"--cache-bytes must be > 0, got {self.cache_bytes}")
        if self.text is not None and not self.text.is_file():
            raise InputError(f"--text {self.text} is not a file")
        if not self.out.parent.is_dir():
            raise InputError(f"--out {self.out}: no directory {self.out.parent}")

    def attach_config(self) -> AttachConfig:
        from kvdrive.tools.bench_common import InputError  # noqa: PLC0415
        from kvdrive_client.config import AttachConfig  # noqa: PLC0415

        try:
            return AttachConfig(budget=self.budget, page_size=self.page_size)
        except ValueError as exc:
            raise InputError(str(exc)) from None


def _note(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _tokens(run: ProfileRun, tok, max_positions: int):
    from kvdrive.tools.bench_common import InputError  # noqa: PLC0415
    from kvdrive_client.models import license_text  # noqa: PLC0415

    if run.text is None:
        text = license_text()
    else:
        try:
            text = run.text.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(f"--text {run.text} is not UTF-8 text") from None
    ids = tok(text, return_tensors="pt").input_ids
    need = run.context + run.steps
    if ids.shape[1] < need * run.sequences:
        raise InputError(f"the text has {ids.shape[1]} tokens; --sequences {run.sequences} x (--context {run.context} "
                         f"+ --steps {run.steps}) needs {need * run.sequences}")
    if need > max_positions:
        raise InputError(f"--context {run.context} + --steps {run.steps} exceeds the model's {max_positions} positions")
    return ids


def _check_cache_bytes(run: ProfileRun, attach_cfg: AttachConfig, num_streams: int, page_bytes: int,
                       k: int | None = None) -> None:
    """Refuse a cache budget below the smallest window everywhere; ``k`` None: before the run, from its first step."""
    from kvdrive.tools.bench_common import InputError  # noqa: PLC0415
    from kvstored.config import format_size  # noqa: PLC0415

    if run.cache_bytes is None:
        return
    if k is None:
        # k of the first decode step: the least any step selects, so this never refuses a budget that fits.
        first_local = (run.context + 1 - attach_cfg.local_tokens) // run.page_size
        k = attach_cfg.pages_to_select(first_local - attach_cfg.sink_pages)
    floor = num_streams * capacity_pages(min(run.choices), k, attach_cfg.sink_pages) * page_bytes
    if run.cache_bytes < floor:
        raise InputError(f"--cache-bytes {run.cache_bytes} cannot hold window {_window(min(run.choices))} for every "
                         f"(layer, KV head): that takes at least {floor} bytes ({format_size(floor)})")


def profile_model(run: ProfileRun) -> tuple[WindowProfile, dict]:
    """Record the model's selection trace on the calibration text and solve for the windows
    (of its global layers: sliding-window layers keep no device cache)."""
    from kvdrive_client import attach  # noqa: PLC0415
    from kvdrive_client.models import load_model  # noqa: PLC0415
    from kvdrive_client.profile import profile_from_trace  # noqa: PLC0415

    t0 = time.perf_counter()
    spec = MODELS[run.model]
    _note(f"loading {spec.display}")
    model, tok = load_model(run.model)
    ids = _tokens(run, tok, model.config.max_position_embeddings)
    info = {"load_s": time.perf_counter() - t0, "text_tokens": ids.shape[1], "sequences": run.sequences}
    attach_cfg = run.attach_config()
    handle = attach(model, dram=DRAM, budget=run.budget, page_size=run.page_size)  # a private embedded kvstored
    try:
        shape = handle.shape
        page_bytes = shape.page_bytes(run.page_size)
        _check_cache_bytes(run, attach_cfg, shape.num_layers * shape.num_kv_heads, page_bytes)
        trace = record_trace(model, handle, ids, run, info)
    finally:
        handle.detach()
    t = time.perf_counter()
    _note(f"replaying the selection trace at {len(run.choices)} windows")
    _check_cache_bytes(run, attach_cfg, shape.num_layers * shape.num_kv_heads, page_bytes, trace.max_selected)
    profile = profile_from_trace(
        trace, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, page_bytes=page_bytes,
        cache_bytes=run.cache_bytes, choices=run.choices, sink_pages=attach_cfg.sink_pages, warmup_steps=WARMUP_STEPS,
        model=spec.display, dtype=str(shape.dtype).removeprefix("torch."), page_size=run.page_size,
        budget=run.budget, text=str(run.text) if run.text else "/usr/share/common-licenses (concatenated)",
        context=run.context)
    info["solve_s"] = time.perf_counter() - t
    return profile, info


def record_trace(model, handle, ids, run: ProfileRun, info: dict):
    """Prefill ``run.context`` tokens of each of ``run.sequences`` consecutive text windows (one batch) through
    ``handle``, decode ``run.steps`` more teacher-forced; the trace (streams: sequence, layer, KV head)."""
    import torch  # noqa: PLC0415

    from kvdrive.tools.bench_common import TraceObserver  # noqa: PLC0415

    need = run.context + run.steps
    windows = ids[0, : need * run.sequences].reshape(run.sequences, need)
    ctx, fed = windows[:, : run.context], windows[:, run.context :]
    tracer = TraceObserver()
    cache = handle.new_cache(run.sequences)
    cache.session.add_observer(tracer)
    try:
        with torch.no_grad():
            t = time.perf_counter()
            _note(f"prefill of {run.sequences} x {run.context} tokens")
            model(input_ids=ctx, cache=cache, logits_to_keep=1)
            info["prefill_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for i in range(run.steps):
                model(input_ids=fed[:, i : i + 1], cache=cache, logits_to_keep=1)
                _note(f"decode step {i + 1}/{run.steps} ({time.perf_counter() - t:.1f} s)")
            info["decode_s"] = time.perf_counter() - t
    finally:
        cache.close()
    return tracer.trace()


# ---------------------------------------------------------------- report


def _budget(budget: float) -> str:
    return f"{budget:.3%}"


def _window(w: float) -> str:
    return f"x{w:g}"


def render(p: WindowProfile, info: dict) -> str:
    from kvstored.config import format_size  # noqa: PLC0415

    u_window, u_bytes, u_fetched = p.uniform()
    u_at = p.choices.index(u_window)
    lines = [
        f"{PROG}: {p.model} {p.dtype} ({p.num_layers} layers x {p.num_kv_heads} KV heads); text {p.text} "
        f"({info['text_tokens']} tokens)",
        f"{info['sequences']} sequence(s) of {p.context} context tokens, then {p.steps + WARMUP_STEPS} teacher-forced "
        f"decode steps, replayed from the "
        f"prefill's cache seeding at each window; budget {_budget(p.budget)} -> k = {p.k} pages per step; page {p.page_size} tokens = "
        f"{format_size(p.page_bytes)} per KV head; {p.sink_pages} sink page(s) per stream",
        f"windows tried: {' '.join(map(_window, p.choices))}; LOOKAHEAD eviction; model load {info['load_s']:.0f} s, "
        f"prefill {info['prefill_s']:.0f} s, decode {info['decode_s']:.0f} s, replay and solve {info['solve_s']:.1f} s",
        "",
    ]
    body = []
    for layer, (row, curves) in enumerate(zip(p.windows, p.misses)):
        chosen = sum(c[p.choices.index(w)] for w, c in zip(row, curves))
        uniform = sum(c[u_at] for c in curves)
        body.append((str(layer), *map(_window, row), f"{chosen:.2f}", f"{uniform:.2f}"))
    heads = tuple(f"head {h}" for h in range(p.num_kv_heads))
    lines += text_table(("layer", *heads, "misses/step", f"uniform {_window(u_window)}"), body)
    fetched = p.fetched_bytes_per_step()
    lines += [
        "",
        *text_table(("windows", "cache bytes", "predicted fetched/step"), [
            ("profile", f"{format_size(p.used_bytes)} ({p.used_bytes})", f"{format_size(fetched)} ({fetched:.0f})"),
            (f"uniform {_window(u_window)}", f"{format_size(u_bytes)} ({u_bytes})",
             f"{format_size(u_fetched)} ({u_fetched:.0f})"),
        ]),
        "",
        f"cache budget {format_size(p.cache_bytes)} ({p.cache_bytes} bytes): the profile uses "
        f"{p.used_bytes / p.cache_bytes:.1%} of it and fetches "
        + (f"{1 - fetched / u_fetched:.1%} fewer bytes per step than uniform {_window(u_window)}"
           if u_fetched > 0 else "as few bytes per step as uniform (none)"),
        "per-head curves trusted at shrink "
        + (f"{p.shrink:.2f} (chosen on held-out calibration data)" if p.shrink > 0 else
           "0: on held-out calibration data no per-head choice beat one window everywhere, so one window is used"),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Choose a device-cache window per (layer, KV head) of a model for a total cache budget, from "
                    "its page selections on calibration text, and write them as a JSON profile.")
    add_version_option(p)
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSON profile to write")
    p.add_argument("--model", default="smollm2", choices=list(MODELS),
                   help="the real model to profile (default smollm2); gemma3-270m: its global layers, the ones KVDrive "
                        "decodes")
    p.add_argument("--text", type=Path, default=None, metavar="FILE",
                   help="UTF-8 calibration text instead of the Debian common licenses")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: {QUICK_CONTEXT}-token context, {QUICK_STEPS} decode steps")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help=f"context tokens before decoding (default {DEFAULT_CONTEXT}, {QUICK_CONTEXT} with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"teacher-forced decode steps (default {DEFAULT_STEPS}, {QUICK_STEPS} with --quick)")
    p.add_argument("--sequences", type=int, default=DEFAULT_SEQUENCES, metavar="N",
                   help=f"calibration sequences, consecutive windows of the text decoded as one batch; with 2 or more "
                        f"each is held out in turn to check the per-head windows (default {DEFAULT_SEQUENCES})")
    p.add_argument("--cache-bytes", default=None, metavar="SIZE",
                   help=f"total device-cache budget, all layers and heads, e.g. 24M (K/M/G: powers of 1024; "
                        f"default: what window x{UNIFORM_WINDOW:g} everywhere takes)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"pages selected per step: a fraction of the selectable pages, as attach(budget=) "
                        f"(default {DEFAULT_BUDGET:g})")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per page, as attach(page_size=) (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--windows", type=float, nargs="+", default=list(DEFAULT_CHOICES), metavar="W",
                   help=f"the windows to choose from, multiples of k (default {' '.join(f'{w:g}' for w in DEFAULT_CHOICES)})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvdrive.tools.bench_common import InputError  # noqa: PLC0415
    from kvstored.config import parse_size  # noqa: PLC0415

    try:
        cache_bytes = None if args.cache_bytes is None else parse_size(args.cache_bytes)
    except ValueError as exc:
        print(f"{PROG}: --cache-bytes: {exc}", file=sys.stderr)
        return 2
    try:
        run = ProfileRun(
            context=args.context if args.context is not None else (QUICK_CONTEXT if args.quick else DEFAULT_CONTEXT),
            steps=args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS),
            sequences=args.sequences, budget=args.budget, page_size=args.page_size, choices=tuple(sorted(set(args.windows))),
            cache_bytes=cache_bytes, text=args.text, out=args.out, model=args.model)
        profile, info = profile_model(run)
    except InputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # the model package
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    profile.save(run.out)
    print(render(profile, info), flush=True)
    print(f"\nwrote {run.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
