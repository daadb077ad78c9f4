"""``python -m kvdrive.tools.gpu_check``: KVDrive's CUDA path measured in one command.

Written for one NVIDIA H200, checked on every CPU host through ``--dry-run``, and run
once on an H200 with ``--budget-s 270``: every stage ended ``ok`` (the README's "On a
GPU" quotes what it measured).

Stages, one after another, each with its own share of ``--budget-s`` (time one stage
leaves unused goes to the ones after it):

1. ``env`` (6%): python, torch, triton, cupy and the carried packages' versions; the GPU
   (name, compute capability, memory, multiprocessors, ``nvidia-smi``); the kernel set
   ``kvdrive.kernels.for_device("cuda")`` picks and every choice of ``KERNEL_CHOICES``;
   an embedded ``kvstored`` started and pinged; where each KVDrive package was imported from.
2. ``gpu_tests`` (28%): ``pytest -q -m gpu tests`` in a subprocess, its time limit the
   stage's share; pass/fail counts, the tail in results.json, the whole output in ``pytest.log``.
3. ``micro`` (12%): micro-benchmarks timed with CUDA events (median of repeats, L2 flushed
   before each), every variant side by side in one run: (a) paged sparse attention at a
   Llama-3-8B decode shape (batch 4, 8 KV heads, 4 query heads per KV head, head dim 128,
   page 16, 128 selected pages of 512 cache slots, 64 local tokens, fp16), the torch
   reference against the Triton kernels where ``KERNEL_CHOICES`` offers ``triton``, each
   with its largest error against a float32 reference; (b) low-rank page selection at
   32K tokens (the default sketch at head dim 128: rank 54, 2 int8, 28 int4 and 24 int2
   channels; top 128 of 2048
   pages), reference against Triton, with the share of top-k pages they agree on; (c)
   host-to-device copies of 8 MiB and 64 MiB staging buffers, non_blocking: pageable memory, a ``pin_memory()`` tensor, and
   a shared-memory mapping (a memfd, as the client's buffers are) registered with
   ``cudaHostRegister``. The copies run first, and a CUDA error that breaks the device
   context skips the benchmarks after it (recorded).
4. ``launches`` (8%): ``kvdrive.tools.opcount`` on the device, Triton kernels then the
   reference ones: torch ops, host syncs and, by the torch profiler, CUDA kernel launches
   and copies per layer per decode step (steps that complete a page among them).
5. ``decode`` (44%): workload (b) of the decode benchmark (``kvdrive.tools.bench_decode``:
   attention only, Llama-3-8B's layer shape, 8 layers, batch 4, synthetic queries of the
   workload's default locality) at 32K tokens, and at 128K if the time left allows, for
   dense attention with all KV in HBM, the ShadowKV-style baseline and KVDrive
   (``kvdrive+pipe``) on a DRAM tier that holds all KV and on DRAM+SSD (half of it),
   KVDrive with the Triton kernels (where offered) right after dense; tokens/s and bytes
   fetched per step for every row.
6. ``summary``: a plain-text report, printed last and saved as ``summary.txt``.

Each stage catches its own errors (recorded, and the next stage runs) and
``results.json`` in ``--out`` is rewritten (a temporary file, then a rename) after every
stage, so a run cut off still leaves what it measured. ``env``, ``micro``, ``launches`` and ``decode``
each run in a child process of their own (the hidden option ``--stage NAME``), so a
CUDA fault or a hang there cannot take the later stages with it: a child still running
10 s past its stage's share is killed and the stage recorded as ``timeout``, with the
results it had saved so far (``micro`` and ``decode`` save after every benchmark or row).

``--dry-run`` runs every stage's plumbing on the CPU: tiny shapes, the reference kernels,
a few decode steps, and every measurement that needs CUDA skipped with the reason
recorded; on a 2-core machine it takes about a minute.

Running from a source checkout. The repository's folders install under other names
(``client/`` is ``kvdrive_client``, ``kernels/`` is ``kvdrive.kernels``, ... as
``[tool.setuptools.package-dir]`` in pyproject.toml says), so in a plain checkout
``import kvdrive_client`` fails and ``python -m kvdrive.tools.gpu_check`` cannot start.
Run it as ``python -m tools.gpu_check`` from the repository root instead: where
``kvdrive_client`` does not resolve to this checkout, the tool builds a temporary folder
of symbolic links (``kvdrive_client -> client``, ``kvdrive/kernels -> kernels``, ...,
``kvstored -> kvstored``), puts it first on ``sys.path`` and on ``PYTHONPATH`` for the
processes it starts (its stage children, pytest, and the ``kvstored`` daemons the
client starts), and removes it at exit. Where KVDrive is installed
(``pip install -e .``), both forms work.

The GPU machine has torch, triton, cupy, numba, numpy, msgpack and transformers but
not pyzmq, lmdb or gguf: ``bash tools/fetch_gpu_wheels.sh`` downloads those for CPython
3.12 into ``.whl/`` (about 1.5 MiB, ignored by git), which the device call carries. The
device command, from the repository root (give it about 90 s more than ``--budget-s``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
        python3 -m tools.gpu_check --out $OUT --budget-s 480

Files in ``--out``: ``results.json``, ``summary.txt``, ``pytest.log`` (and, only while a
stage child runs or if the run was cut off, ``part-STAGE.json`` with what it has so far).
Exit status: 0 when every stage ended ``ok`` or ``skipped``, 1 when one failed, errored or
timed out, 2 for bad options.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

MODULE = "kvdrive.tools.gpu_check"
RESULTS = "results.json"
SUMMARY = "summary.txt"
PYTEST_LOG = "pytest.log"
DECODE_WARMUP_STEPS = 17  # the decode stage's: the micro-batch candidates, and a page completed
GRACE_S = 10.0  # a stage child still running this long past its share is killed
MIB = 1 << 20

# [tool.setuptools.package-dir] of pyproject.toml, used where that file cannot be read.
PACKAGE_DIRS = {"kvstored": "kvstored", "kvdrive_client": "client", "kvdrive.layout": "layout",
                "kvdrive.protocol": "protocol", "kvdrive.kernels": "kernels", "kvdrive.tools": "tools"}


# ---------------------------------------------------------------- running from a source checkout


def source_root() -> Path | None:
    """The checkout this file lives in (``tools/`` of it), or None where KVDrive is installed."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "client" / "__init__.py").is_file():
        return root
    return None


def package_dirs(root: Path) -> dict[str, str]:
    """Import name -> folder of the checkout, from pyproject.toml's ``[tool.setuptools.package-dir]``."""
    try:
        import tomllib  # noqa: PLC0415

        with open(root / "pyproject.toml", "rb") as f:
            dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
        return {str(k): str(v) for k, v in dirs.items()} or dict(PACKAGE_DIRS)
    except (OSError, KeyError, ValueError):
        return dict(PACKAGE_DIRS)


def _resolves_into(name: str, folder: Path) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    return Path(spec.origin).resolve().parent == folder.resolve()


def ensure_importable() -> str | None:
    """Make ``kvdrive_client``, ``kvdrive.*`` and ``kvstored`` import from this checkout.

    Nothing to do where they already do (an install of this checkout, or a child of a run
    that set this up). Otherwise: a temporary folder of symbolic links named as the
    packages install, first on ``sys.path`` and on ``PYTHONPATH`` (for the processes this
    one starts), removed at exit. Returns that folder, or None.
    """
    root = source_root()
    if root is None:
        return None
    dirs = package_dirs(root)
    if _resolves_into("kvdrive_client", root / dirs.get("kvdrive_client", "client")):
        return None
    shim = Path(tempfile.mkdtemp(prefix="kvdrive-src-"))
    for name, folder in dirs.items():
        link = shim.joinpath(*name.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)  # kvdrive/ stays a namespace package (no __init__)
        link.symlink_to(root / folder, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    atexit.register(shutil.rmtree, shim, True)
    return str(shim)


# ---------------------------------------------------------------- results


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON atomically: a temporary file in the same folder, then a rename."""
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _tail(text: str, chars: int = 3000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


class StageSkipped(Exception):
    """A stage that has nothing to run here; the message is the reason recorded."""


@dataclass
class Context:
    """What a stage runs with. ``deadline`` is a ``time.time()``; ``save`` writes the stage's
    data so far where the runner reads it (results.json, or the child's part file)."""

    out: Path
    dry_run: bool
    deadline: float
    tests: list[str] = field(default_factory=lambda: ["tests"])
    contexts: list[int] = field(default_factory=lambda: [32768, 131072])
    layers: int = 8
    steps: int = 12
    results: dict = field(default_factory=dict)
    save: Callable[[], None] = lambda: None

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def left(self) -> float:
        return self.deadline - time.time()


@dataclass
class Stage:
    name: str
    share: float  # of the budget; what a stage leaves goes to the later ones in proportion
    fn: Callable[[Context, dict], None]
    isolated: bool = False  # runs in a child process of its own


def _run_inline(stage: Stage, ctx: Context, record: dict) -> None:
    data = record["data"]
    try:
        stage.fn(ctx, data)
        record["status"] = data.pop("_status", "ok")
    except StageSkipped as exc:
        record["status"], record["reason"] = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 - a stage's failure is recorded; the next stage runs
        record["status"], record["error"] = "error", _error_text(exc)
        record["traceback"] = _tail(traceback.format_exc(), 4000)


def _child_command(stage: Stage, ctx: Context, part: Path) -> list[str]:
    cmd = [sys.executable, "-m", MODULE, "--stage", stage.name, "--part", str(part), "--out", str(ctx.out),
           "--deadline", repr(ctx.deadline), "--decode-contexts", ",".join(map(str, ctx.contexts)),
           "--decode-layers", str(ctx.layers), "--decode-steps", str(ctx.steps), "--tests", *ctx.tests]
    return cmd + (["--dry-run"] if ctx.dry_run else [])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _run_isolated(stage: Stage, ctx: Context, record: dict) -> None:
    """The stage in ``python -m kvdrive.tools.gpu_check --stage NAME``; its part file is its record."""
    part = ctx.out / f"part-{stage.name}.json"
    part.unlink(missing_ok=True)
    root = source_root()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen(_child_command(stage, ctx, part), stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(root) if root else None, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, ctx.left() + GRACE_S))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        log.seek(0)
        output = log.read()
    child: dict = {}
    if part.is_file():
        try:
            child = json.loads(part.read_text(encoding="utf-8"))
        except ValueError as exc:
            child = {"status": "error", "error": f"unreadable part file: {exc}"}
        part.unlink(missing_ok=True)
    record["data"] = child.get("data", {})
    for key in ("status", "reason", "error", "traceback"):
        if key in child:
            record[key] = child[key]
    record["child_rc"] = proc.returncode
    record["log_tail"] = _tail(output, 3000)
    if timed_out:
        if record.get("status") in (None, "running"):
            record["status"] = "timeout"
        record["timeout"] = f"still running {GRACE_S:.0f} s past the stage's share; killed"
    elif record.get("status") in (None, "running"):
        record["status"] = "error"
        record.setdefault("error", f"the stage's process exited with {proc.returncode} before it finished")


def run_stages(stages: list[Stage], ctx: Context, results: dict, budget_s: float, selected: set[str] | None = None,
               log: Callable[[str], None] = print) -> dict:
    """Run ``stages`` in order within ``budget_s``, rewriting results.json after each."""
    t0 = time.time()
    end = t0 + budget_s
    path = ctx.out / RESULTS
    stage_results = results.setdefault("stages", {})
    for s in stages:
        stage_results[s.name] = {"status": "pending"}
    ctx.results = results
    write_json(path, results)
    for i, stage in enumerate(stages):
        record = stage_results[stage.name]
        if selected is not None and stage.name not in selected:
            record.update(status="skipped", reason="not in --stages")
            write_json(path, results)
            continue
        start = time.time()
        later = sum(s.share for s in stages[i:] if selected is None or s.name in selected)
        allotted = max(0.0, end - start) * (stage.share / later if later > 0 else 1.0)
        ctx.deadline = start + allotted
        record.clear()
        record.update(status="running", allotted_s=round(allotted, 1), started_s=round(start - t0, 1), data={})

        ctx.save = lambda: write_json(path, results)
        log(f"[{start - t0:6.1f} s] {stage.name}: {allotted:.0f} s")
        if stage.isolated:
            _run_isolated(stage, ctx, record)
        else:
            _run_inline(stage, ctx, record)
        record["seconds"] = round(time.time() - start, 2)
        note = record.get("error") or record.get("reason") or record.get("timeout") or ""
        log(f"[{time.time() - t0:6.1f} s] {stage.name}: {record['status']} in {record['seconds']:.1f} s"
            + (f": {note.splitlines()[0][:200]}" if note else ""))
        results["seconds"] = round(time.time() - t0, 2)
        write_json(path, results)
    return results


def _child_main(args: argparse.Namespace) -> int:
    """One isolated stage: its record is written to ``--part`` after every step and at the end."""
    part = Path(args.part)
    record: dict = {"status": "running", "data": {}}
    ctx = Context(Path(args.out), args.dry_run, args.deadline, args.tests, args.decode_contexts, args.decode_layers,
                  args.decode_steps, save=lambda: write_json(part, record))
    stage = next(s for s in STAGES if s.name == args.stage)
    ctx.save()
    _run_inline(stage, ctx, record)
    write_json(part, record)
    return 0


# ---------------------------------------------------------------- timing


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def time_ms(fn: Callable[[], object], device, reps: int, warmup: int = 3, flush=None) -> dict:
    """Milliseconds per call of ``fn``: CUDA events around each call on a CUDA device (``flush``,
    a large tensor, zeroed before each so no call finds the last one's data in L2), else the
    wall clock. Median and minimum over ``reps`` calls after ``warmup``."""
    import torch  # noqa: PLC0415

    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = []
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            events.append((start, stop))
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) for a, b in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": round(_median(times), 4), "ms_min": round(min(times), 4), "reps": reps,
            "timer": "cuda events" if device.type == "cuda" else "wall clock"}


# ---------------------------------------------------------------- stage: env


def _version(name: str, module: str | None = None) -> str | None:
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(__import__(module or name), "__version__", "?"))
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        return f"missing ({_error_text(exc)})"


def stage_env(ctx: Context, data: dict) -> None:
    import platform  # noqa: PLC0415

    data["python"] = sys.version.split()[0]
    data["platform"] = platform.platform()
    data["cpus"] = os.cpu_count()
    data["versions"] = {name: _version(name, module) for name, module in (
        ("torch", None), ("triton", None), ("cupy-cuda13x", "cupy"), ("numba", None), ("numpy", None),
        ("msgpack", None), ("pyzmq", "zmq"), ("lmdb", None), ("gguf", None), ("transformers", None))}
    ctx.save()
    import torch  # noqa: PLC0415

    data["torch_cuda"] = torch.version.cuda
    data["cuda_available"] = torch.cuda.is_available()
    if data["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        data["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                       "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
                       "l2_mib": round(getattr(props, "L2_cache_size", 0) / MIB, 1), "count": torch.cuda.device_count()}
        x = torch.arange(4, device="cuda", dtype=torch.float32)
        data["gpu"]["smoke"] = float((x * 2).sum().item())  # 12.0
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        data["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        data["nvidia_smi"] = f"unavailable ({_error_text(exc)})"
    ctx.save()
    import kvdrive.kernels as kernels  # noqa: PLC0415

    data["kernel_choices"] = list(kernels.KERNEL_CHOICES)
    chosen = {}
    for device in ("cuda", "cpu"):
        for choice in kernels.KERNEL_CHOICES:
            try:
                k = kernels.for_device(device, choice)
                chosen[f"{device}/{choice}"] = {"name": k.name, "class": type(k).__name__,
                                                "attends_in_parts": k.attends_in_parts}
            except Exception as exc:  # noqa: BLE001 - what a choice says on this machine is the result
                chosen[f"{device}/{choice}"] = {"error": _error_text(exc)}
    data["kernels"] = chosen
    data["kernels_for_cuda"] = chosen["cuda/auto"].get("name", chosen["cuda/auto"].get("error"))
    importlib.import_module("kvdrive.tools.bench_decode")  # what the decode stage's runner imports
    import kvdrive_client  # noqa: PLC0415
    import kvstored  # noqa: PLC0415

    data["imported_from"] = {m.__name__: m.__file__ for m in (kvdrive_client, kernels, kvstored)}
    data["imported_from_resolved"] = {m.__name__: os.path.realpath(m.__file__) for m in (kvdrive_client, kernels, kvstored)}
    ctx.save()
    from kvdrive_client import connect  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        with connect(None, dram="64M", ssd_max="1G") as store:
            data["kvstored"] = {"status": "ok" if store.ping(timeout=5.0) else "no answer",
                                "seconds": round(time.perf_counter() - t0, 2)}
    except Exception as exc:  # noqa: BLE001
        data["kvstored"] = {"status": "error", "error": _error_text(exc)}


# ---------------------------------------------------------------- stage: gpu_tests

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 1 failed in 2.0s``)."""
    for line in reversed(output.splitlines()):
        found = _COUNT.findall(line)
        if found and (" in " in line or "no tests ran" in line):
            counts = {}
            for n, what in found:
                key = {"error": "errors", "warning": "warnings"}.get(what, what)
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


def stage_gpu_tests(ctx: Context, data: dict) -> None:
    root = source_root() or Path.cwd()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs",
           "--continue-on-collection-errors", *ctx.tests]
    data["command"] = " ".join(cmd[1:])
    log_path = ctx.out / PYTEST_LOG
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(root), start_new_session=True)
        try:
            data["rc"] = proc.wait(timeout=max(1.0, ctx.left()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            data["rc"] = None
    output = log_path.read_text(encoding="utf-8", errors="replace")
    data["seconds"] = round(time.perf_counter() - t0, 2)
    data["counts"] = pytest_counts(output)
    data["tail"] = _tail(output, 4000)
    data["log"] = PYTEST_LOG
    if data["rc"] is None:
        data["_status"] = "timeout"
    elif data["rc"] not in (0, 5):  # 5: no test selected
        data["_status"] = "failed"


# ---------------------------------------------------------------- stage: micro


@dataclass(frozen=True)
class MicroShape:
    batch: int = 4
    kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    page: int = 16
    selected: int = 128
    slots: int = 512  # cache slots per (row, KV head): attach()'s x4 cache of the selection
    local: int = 64
    rank: int = 54  # the low-rank index's default sketch at head dim 128: 27/64 of it,
    int8_channels: int = 2  # its first 2 channels int8,
    int2_channels: int = 24  # its last 24 int2, the rest int4 (22 bytes a token)
    tokens: int = 32768  # low-rank select's indexed tokens
    cached: int = 512  # cached pages whose scores the selection also returns


TINY = MicroShape(batch=1, kv_heads=2, group=2, head_dim=32, page=16, selected=4, slots=8, local=16, rank=8,
                  int8_channels=2, int2_channels=2, tokens=256, cached=8)


def _kernel_variants(device) -> list[tuple[str, object | None, str | None]]:
    """(label, kernels or None, why not) for the reference and, where offered, Triton."""
    import kvdrive.kernels as kernels  # noqa: PLC0415

    out = [("reference", kernels.for_device(device, "reference"), None)]
    if "triton" not in kernels.KERNEL_CHOICES:
        out.append(("triton", None, "kvdrive.kernels.KERNEL_CHOICES offers no 'triton'"))
    elif device.type != "cuda":
        out.append(("triton", None, "needs a CUDA device (Triton's interpreter is no benchmark)"))
    else:
        try:
            out.append(("triton", kernels.for_device(device, "triton"), None))
        except Exception as exc:  # noqa: BLE001
            out.append(("triton", None, _error_text(exc)))
    return out


def _flush_buffer(device):
    import torch  # noqa: PLC0415

    return torch.empty(256 * MIB, dtype=torch.uint8, device=device) if device.type == "cuda" else None


def micro_attention(device, shape: MicroShape, reps: int) -> dict:
    import torch  # noqa: PLC0415

    sh = shape
    g = torch.Generator(device=device).manual_seed(0)
    b, h, gq, d, s, k, c, l = sh.batch, sh.kv_heads, sh.group, sh.head_dim, sh.page, sh.selected, sh.slots, sh.local
    half = torch.float16
    query = torch.randn(b, h, gq, d, device=device, generator=g).to(half)
    cache_k = torch.randn(b, h, c, s, d, device=device, generator=g).to(half)
    cache_v = torch.randn(b, h, c, s, d, device=device, generator=g).to(half)
    slots = torch.rand(b, h, c, device=device, generator=g).argsort(dim=-1)[..., :k].contiguous()
    local_k = torch.randn(b, h, l, d, device=device, generator=g).to(half)
    local_v = torch.randn(b, h, l, d, device=device, generator=g).to(half)
    valid = torch.ones(b, h, k * s + l, dtype=torch.bool, device=device)
    scaling = d**-0.5
    read = 2 * b * h * (k * s + l) * d * 2  # K and V of the attended tokens, fp16
    import kvdrive.kernels as kernels  # noqa: PLC0415

    exact = kernels.for_device(device, "reference").attention(
        query.float(), cache_k.float(), cache_v.float(), slots, local_k.float(), local_v.float(), valid, scaling).float()
    result = {"shape": {"batch": b, "kv_heads": h, "group": gq, "head_dim": d, "page": s, "selected_pages": k,
                        "cache_slots": c, "local_tokens": l, "dtype": "float16"},
              "bytes_read": read, "variants": []}
    flush = _flush_buffer(device)
    for label, kern, why in _kernel_variants(device):
        row: dict = {"variant": label}
        if kern is None:
            row.update(status="skipped", reason=why)
        else:
            try:
                def call(kern=kern):
                    return kern.attention(query, cache_k, cache_v, slots, local_k, local_v, valid, scaling)

                out = call().float()
                row.update(status="ok", kernels=kern.name, max_abs_err=float((out - exact).abs().max()),
                           **time_ms(call, device, reps, flush=flush))
                row["gb_per_s"] = round(read / (row["ms"] * 1e-3) / 1e9, 1)
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", error=_error_text(exc))
        result["variants"].append(row)
    return result


def micro_lowrank(device, shape: MicroShape, reps: int) -> dict:
    import torch  # noqa: PLC0415

    from kvdrive.kernels import reference as ref  # noqa: PLC0415

    sh = shape
    g = torch.Generator(device=device).manual_seed(1)
    b, h, gq, d, t, s = sh.batch, sh.kv_heads, sh.group, sh.head_dim, sh.tokens, sh.page
    layout = ref.SketchLayout(sh.rank, sh.int8_channels, sh.int2_channels)
    r, wide = layout.rank, layout.int8
    p, k = t // s, sh.selected
    query = torch.randn(b, h, gq, d, device=device, generator=g).to(torch.float16)
    qproj = torch.randn(b, h, d, r, device=device, generator=g) * 0.1
    scale = torch.rand(b, h, r, device=device, generator=g) * 0.05 + 1e-3
    values = torch.randint(-127, 128, (b, h, r, t), device=device, generator=g, dtype=torch.int8)
    values[:, :, wide:] = torch.randint(-8, 8, values[:, :, wide:].shape, device=device, generator=g, dtype=torch.int8)
    narrow = values[:, :, r - layout.int2:]
    narrow.copy_(torch.randint(-2, 2, narrow.shape, device=device, generator=g, dtype=torch.int8))
    codes = ref.pack_lowrank_codes(values, layout).contiguous()
    valid = torch.ones(b, t, dtype=torch.bool, device=device)
    selectable = torch.ones(b, p, dtype=torch.bool, device=device)
    cached = torch.rand(b, h, p, device=device, generator=g).argsort(dim=-1)[..., : sh.cached].contiguous()
    scaling = d**-0.5
    result = {"shape": {"batch": b, "kv_heads": h, "group": gq, "head_dim": d, "rank": r, "int8_channels": wide,
                        "int2_channels": layout.int2,
                        "tokens": t, "pages": p, "top_k": k, "cached_pages": sh.cached},
              "bytes_read": codes.numel(), "variants": []}
    flush = _flush_buffer(device)
    base = None
    for label, kern, why in _kernel_variants(device):
        row: dict = {"variant": label}
        if kern is None:
            row.update(status="skipped", reason=why)
        else:
            try:
                def call(kern=kern):
                    return kern.lowrank_select(query, qproj, scale, scaling, codes, valid, selectable, k, s, cached,
                                               layout)

                pages, top, _ = call()
                if base is None:
                    base = (pages, top)
                else:
                    same = (pages[..., :, None] == base[0][..., None, :]).any(dim=-1).float().mean()
                    finite = torch.isfinite(base[1]) & torch.isfinite(top)
                    row["top_k_agreement"] = round(float(same), 4)
                    if bool(finite.any()):
                        row["max_abs_err_top_scores"] = float((top.float() - base[1].float())[finite].abs().max())
                row.update(status="ok", kernels=kern.name, **time_ms(call, device, reps, flush=flush))
                row["gb_per_s"] = round(codes.numel() / (row["ms"] * 1e-3) / 1e9, 1)
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", error=_error_text(exc))
        result["variants"].append(row)
    return result


def _register_host(ptr: int, nbytes: int) -> tuple[Callable[[], None] | None, str]:
    """cudaHostRegister ``nbytes`` at ``ptr`` (torch's cudart, else cupy's): (unregister, how)."""
    import torch  # noqa: PLC0415

    errors = []
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(rc) == 0:
            return (lambda: cudart.cudaHostUnregister(ptr)), "torch.cuda.cudart().cudaHostRegister"
        errors.append(f"torch cudaHostRegister returned {rc}")
    except Exception as exc:  # noqa: BLE001
        errors.append(f"torch: {_error_text(exc)}")
    try:
        from cupy.cuda import runtime  # noqa: PLC0415

        runtime.hostRegister(ptr, nbytes, 0)
        return (lambda: runtime.hostUnregister(ptr)), "cupy.cuda.runtime.hostRegister"
    except Exception as exc:  # noqa: BLE001
        errors.append(f"cupy: {_error_text(exc)}")
    return None, "; ".join(errors)


def micro_copy(device, sizes_mib: tuple[int, ...] = (8, 64)) -> dict:
    if device.type != "cuda":
        raise StageSkipped("host-to-device copies need a CUDA device")
    import mmap  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    result: dict = {"variants": []}
    for mib in sizes_mib:
        n = mib * MIB
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        reps = 20 if mib <= 8 else 10

        def bench(label: str, src, note: str = "") -> None:
            row = {"size_mib": mib, "variant": label, "pinned": bool(src.is_pinned())}
            try:
                row.update(status="ok", **time_ms(lambda: dst.copy_(src, non_blocking=True), device, reps))
                row["gb_per_s"] = round(n / (row["ms"] * 1e-3) / 1e9, 2)
                ok = bool(torch.equal(dst[:4096].cpu(), src[:4096]))
                row["copied_right"] = ok
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", error=_error_text(exc))
            if note:
                row["note"] = note
            result["variants"].append(row)

        pageable = torch.full((n,), 1, dtype=torch.uint8)
        bench("pageable", pageable)
        del pageable
        try:
            pinned = torch.full((n,), 2, dtype=torch.uint8).pin_memory()
            bench("pin_memory()", pinned)
            del pinned
        except Exception as exc:  # noqa: BLE001
            result["variants"].append({"size_mib": mib, "variant": "pin_memory()", "status": "error",
                                       "error": _error_text(exc)})
        fd = os.memfd_create("kvdrive-staging")
        try:
            os.ftruncate(fd, n)
            mapping = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            arr = np.frombuffer(mapping, dtype=np.uint8)
            arr[:] = 3
            unregister, how = _register_host(arr.ctypes.data, n)
            src = torch.from_numpy(arr)
            if unregister is None:
                result["variants"].append({"size_mib": mib, "variant": "memfd + cudaHostRegister", "status": "error",
                                           "error": how})
            else:
                bench("memfd + cudaHostRegister", src, how)
                torch.cuda.synchronize(device)
                unregister()
            del src, arr
            try:
                mapping.close()
            except BufferError:  # a view still holds it; the collector frees it
                pass
        finally:
            os.close(fd)
    return result


def _stage_device(ctx: Context):
    """The stage's torch device (refused when CUDA is asked for and torch sees none); no gradients."""
    import torch  # noqa: PLC0415

    device = torch.device(ctx.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    torch.set_grad_enabled(False)
    return device


def stage_micro(ctx: Context, data: dict) -> None:
    import torch  # noqa: PLC0415

    device = _stage_device(ctx)
    shape, reps = (TINY, 3) if ctx.dry_run else (MicroShape(), 20)
    data["device"] = str(device)
    broken = None  # a CUDA error that outlives its call (an illegal address, say) fails all later work here
    # The copies first: torch alone, nothing there can break the context for the kernels after.
    for name, run in (("h2d_copy", lambda: micro_copy(device)),
                      ("attention", lambda: micro_attention(device, shape, reps)),
                      ("lowrank_select", lambda: micro_lowrank(device, shape, reps))):
        if broken or ctx.left() < 5:
            data[name] = {"status": "skipped", "reason": broken or f"the stage's share ran out ({ctx.left():.0f} s left)"}
            continue
        t0 = time.perf_counter()
        try:
            data[name] = {"status": "ok", **run()}
        except StageSkipped as exc:
            data[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001
            data[name] = {"status": "error", "error": _error_text(exc), "traceback": _tail(traceback.format_exc(), 2000)}
        data[name]["seconds"] = round(time.perf_counter() - t0, 2)
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception as exc:  # noqa: BLE001
                broken = f"the CUDA context broke during {name}: {_error_text(exc)}"
                data["cuda_context"] = broken
        ctx.save()
    if any(v.get("status") == "error" for v in data.values() if isinstance(v, dict)):
        data["_status"] = "failed"


# ---------------------------------------------------------------- stage: decode


class ResidentPrefill:
    """A :class:`~kvdrive.tools.decode_workload.SyntheticAttention` whose prompt KV is made once
    per layer and kept on ``device``: every row of the stage prefills from the same tensors
    (copies), without generating them again on the CPU."""

    def __init__(self, workload, device) -> None:
        self._workload = workload
        self._device = device
        self._kv: dict[int, tuple] = {}

    def __getattr__(self, name):
        return getattr(self._workload, name)

    def prefill_kv(self, layer: int):
        if layer not in self._kv:
            self._kv[layer] = tuple(x.to(self._device) for x in self._workload.prefill_kv(layer))
        return tuple(x.clone() for x in self._kv[layer])


def stage_launches(ctx: Context, data: dict) -> None:
    """Torch ops, host syncs and CUDA kernel launches per layer per decode step (opcount on the device)."""
    from kvdrive.tools import opcount  # noqa: PLC0415
    from kvdrive_client import connect  # noqa: PLC0415

    device = _stage_device(ctx)
    data.update(device=str(device), rows=[])
    steps = 4 if ctx.dry_run else 18  # the 16th counted step completes a page
    with connect(None) as store:
        for kernels in ("triton", "reference") if device.type == "cuda" else ("reference",):
            if ctx.left() < 10:
                data["rows"].append({"kernels": kernels, "status": "skipped",
                                     "reason": f"the stage's share ran out ({ctx.left():.0f} s left)"})
                continue
            t0 = time.perf_counter()
            try:
                r = opcount.count_decode(store, kernels, steps=steps, device=str(device))
                row = {k: r[k] for k in ("kernels", "ops_per_layer_step", "steady", "page", "syncs_per_layer_step",
                                         "launches_per_layer_step") if k in r}
                row.update({k: v for k, v in r.items() if k.startswith("cuda_")}, status="ok")
            except Exception as exc:  # noqa: BLE001 - a row's failure is recorded; the next row runs
                row = {"kernels": kernels, "status": "error", "error": _error_text(exc),
                       "traceback": _tail(traceback.format_exc(), 2000)}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            data["rows"].append(row)
            ctx.save()


def decode_rows(kernel_choices: list[str], device_type: str) -> list[tuple[str, str, str]]:
    """(configuration, kernels, tier) in the order they run: each configuration's tiers back to
    back, as the decode benchmark runs them. The Triton rows, the kernels KVDrive picks on a
    GPU, come right after dense, so that a stage whose share runs short still measures them."""
    rows = [("dense", "auto", "hbm" if device_type == "cuda" else "-")]
    if "triton" in kernel_choices:
        rows += [("kvdrive+pipe", "triton", "dram"), ("kvdrive+pipe", "triton", "dram+ssd")]
    for name in ("shadowkv", "kvdrive+pipe"):
        rows += [(name, "auto", "dram"), (name, "auto", "dram+ssd")]
    return rows


def stage_decode(ctx: Context, data: dict) -> None:
    from dataclasses import asdict, replace  # noqa: PLC0415

    import torch  # noqa: PLC0415

    import kvdrive.kernels as kernels  # noqa: PLC0415
    from kvdrive.tools import bench_decode as bd  # noqa: PLC0415
    from kvdrive.tools.decode_workload import SyntheticAttention  # noqa: PLC0415
    from kvdrive_client import connect  # noqa: PLC0415

    device = _stage_device(ctx)
    if ctx.dry_run:
        cfg = bd.BenchConfig(quick=True, workloads=("b",), layers_b=1, context_b=2048, batch_b=2, steps_b=2,
                             warmup=bd.QUICK_WARMUP_STEPS)
        contexts = [2048]
    else:
        # A warm-up past the first page completion (step 16): on the H200 the first Triton row's
        # measured steps otherwise paid the kernels' first compiles (761 of 1105 ms a step in select).
        cfg = bd.BenchConfig(workloads=("b",), layers_b=ctx.layers, batch_b=4, steps_b=ctx.steps,
                             warmup=DECODE_WARMUP_STEPS)
        contexts = list(ctx.contexts)
    configs = {c.name: c for c in bd.configurations()}
    data.update(device=str(device), layers=cfg.layers_b, batch=cfg.batch_b, steps=cfg.steps_b, warmup=cfg.warmup,
                description="workload (b) of kvdrive.tools.bench_decode: attention only, Llama-3-8B's layer shape "
                "(8 KV heads, 32 query heads, head dim 128, fp16), synthetic queries at the workload's default "
                "locality (no model runs)", rows=[], skipped_contexts=[])
    choices = list(kernels.KERNEL_CHOICES)
    plan = decode_rows(choices, device.type)
    prev_ctx, prev_seconds = None, {}
    for context in contexts:
        t_ctx = time.perf_counter()
        if prev_ctx is not None:
            estimate = sum(prev_seconds.values()) * context / prev_ctx * 1.15
            if estimate > ctx.left():
                data["skipped_contexts"].append({"context": context, "reason": (
                    f"an estimated {estimate:.0f} s ({context // prev_ctx}x the {prev_ctx}-token rows' "
                    f"{sum(prev_seconds.values()):.0f} s), {ctx.left():.0f} s left")})
                ctx.save()
                continue
        base = SyntheticAttention.llama3_8b(num_layers=cfg.layers_b, batch=cfg.batch_b, context_tokens=context,
                                            seed=cfg.seed)
        data.setdefault("alpha", base.alpha)
        workload = ResidentPrefill(base, device)
        kv_bytes = 2 * base.num_layers * base.batch * base.num_kv_heads * base.context_tokens * base.head_dim * 2
        # The tiers and SSD cap of bench_decode.run_workloads_bc: all KV in DRAM, or half of it.
        tiers = {"dram": int(kv_bytes * 1.25) + (64 << 20), "dram+ssd": kv_bytes // 2}
        ssd_max = f"{(2 * kv_bytes + (1 << 30)) >> 20}M"
        seconds_here: dict = {}
        last = None
        for name, choice, tier in plan:
            entry: dict = {"context": context, "config": name, "tier": tier, "kernels_choice": choice}
            if ctx.dry_run and name != "dense":
                choice = "reference" if choice == "auto" else choice
            if choice == "triton" and device.type != "cuda":
                entry.update(status="skipped", reason="the Triton kernels need a CUDA device")
                data["rows"].append(entry)
                continue
            estimate = (prev_seconds.get((name, choice, tier), 0.0) * context / prev_ctx if prev_ctx else 0.0) or \
                (last or 0.0)
            if estimate > ctx.left() or ctx.left() < 5:
                entry.update(status="skipped", reason=f"the stage's share: an estimated {estimate:.0f} s, "
                                                      f"{ctx.left():.0f} s left")
                data["rows"].append(entry)
                ctx.save()
                continue
            t0 = time.perf_counter()
            try:
                c = configs[name]
                if c.store:
                    c = replace(c, options={**c.options, "kernels": choice})
                    entry["kernels"] = kernels.for_device(device, choice).name
                else:
                    entry["kernels"] = kernels.for_device(device).name
                with connect(None, dram=f"{tiers[tier] >> 20}M", ssd_max=ssd_max) if c.store else nullcontext() as store:
                    seconds, stats, bb, used, _ = bd._run_attention(workload, c, store, cfg.steps_b, None, cfg,
                                                                   f"gpu_check: {context}: {tier}: {name}", device=device)
                row = bd._row("b", c, tier, base.batch, cfg.steps_b, seconds, stats, bb, used)
                entry.update(status="ok", **asdict(row))
                entry["tier"] = tier
                entry["bytes_per_step"] = row.bytes_per_step_dram + row.bytes_per_step_ssd
            except Exception as exc:  # noqa: BLE001 - a row's failure is recorded; the next row runs
                entry.update(status="error", error=_error_text(exc), traceback=_tail(traceback.format_exc(), 2000))
            entry["row_seconds"] = round(time.perf_counter() - t0, 2)
            if name != "dense":  # dense pays the workload's one-time set-up: no estimate of a KVDrive row
                last = entry["row_seconds"]
            seconds_here[(name, choice, tier)] = entry["row_seconds"]
            data["rows"].append(entry)
            ctx.save()
        data.setdefault("context_seconds", {})[str(context)] = round(time.perf_counter() - t_ctx, 1)
        prev_ctx, prev_seconds = context, seconds_here
        del workload
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if any(r.get("status") == "error" for r in data["rows"]):
        data["_status"] = "failed"
    elif not any(r.get("status") == "ok" for r in data["rows"]):
        data["_status"] = "skipped"


# ---------------------------------------------------------------- stage: summary


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return ["  " + line for line in lines]


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def render_summary(results: dict) -> str:
    stages = results.get("stages", {})
    lines = [f"KVDrive GPU check{' (dry run: CPU plumbing only)' if results.get('dry_run') else ''}: "
             f"{results.get('started_utc', '?')}, budget {results.get('budget_s', '?')} s, "
             f"ran {results.get('seconds', 0):.0f} s" + (f", import shim {results['import_shim']}"
                                                          if results.get("import_shim") else "")]
    lines += ["", "stages:"]
    body = []
    for name, r in stages.items():
        if name == "summary":  # this report
            continue
        note = r.get("error") or r.get("reason") or r.get("timeout") or ""
        body.append([name, r.get("status", "?"), _f(r.get("seconds"), ".1f"), _f(r.get("allotted_s"), ".0f"),
                     note.splitlines()[0][:100] if note else ""])
    lines += _table(["stage", "status", "seconds", "share s", "note"], body)
    env = stages.get("env", {}).get("data", {})
    if env:
        v = env.get("versions", {})
        gpu = env.get("gpu") or {}
        lines += ["", "env: python {} | torch {} (CUDA {}) | triton {} | cupy {} | numba {}".format(
            env.get("python"), v.get("torch"), env.get("torch_cuda"), v.get("triton"), v.get("cupy-cuda13x"),
            v.get("numba"))]
        lines.append("  GPU: " + (f"{gpu.get('name')} (capability {gpu.get('capability')}, {gpu.get('memory_gib')} GiB, "
                                  f"{gpu.get('multiprocessors')} SMs)" if gpu else
                                  f"none (torch.cuda.is_available() is {env.get('cuda_available')})"))
        lines.append(f"  kernels for cuda: {env.get('kernels_for_cuda')} (choices {', '.join(env.get('kernel_choices', []))})"
                     f"; kvstored: {(env.get('kvstored') or {}).get('status')}")
    tests = stages.get("gpu_tests", {}).get("data", {})
    if tests:
        counts = ", ".join(f"{n} {k}" for k, n in tests.get("counts", {}).items()) or "no summary line"
        lines += ["", f"gpu tests: {counts} (rc {tests.get('rc')}, {tests.get('seconds')} s; {tests.get('log')})"]
    micro = stages.get("micro", {}).get("data", {})
    if micro:
        lines += ["", f"micro ({micro.get('device')}):"]
        body = []
        for name in ("attention", "lowrank_select", "h2d_copy"):
            m = micro.get(name)
            if not m:
                continue
            if m.get("status") != "ok" or not m.get("variants"):
                body.append([name, "-", m.get("status", "?"), "-", "-", "-", (m.get("reason") or m.get("error") or "")[:90]])
                continue
            for r in m["variants"]:
                label = name if name != "h2d_copy" else f"h2d {r.get('size_mib')} MiB"
                check = r.get("max_abs_err", r.get("max_abs_err_top_scores"))
                agree = f", top-k agree {r['top_k_agreement']:.3f}" if "top_k_agreement" in r else ""
                ok = f"copied right: {r['copied_right']}" if "copied_right" in r else ""
                body.append([label, r.get("variant", "?"), r.get("status", "?"), _f(r.get("ms"), ".4f"),
                             _f(r.get("gb_per_s"), ".1f"), _f(check, ".2e"),
                             ((r.get("reason") or r.get("error") or ok or "") + agree)[:90]])
        lines += _table(["benchmark", "variant", "status", "ms", "GB/s", "err vs ref", "note"], body)
    launches = stages.get("launches", {}).get("data", {})
    if launches:
        lines += ["", f"launches per layer per decode step ({launches.get('device')}; opcount's model, batch 2):"]
        body = [[r.get("kernels", "?"), r.get("status", "?"), _f(r.get("ops_per_layer_step"), ".1f"),
                 _f(r.get("steady"), ".1f"), _f(r.get("page"), ".1f"), _f(r.get("syncs_per_layer_step"), ".1f"),
                 _f(r.get("cuda_launches_per_layer_step"), ".1f"), _f(r.get("cuda_copies_per_layer_step"), ".1f"),
                 (r.get("reason") or r.get("error") or "")[:80]] for r in launches.get("rows", [])]
        lines += _table(["kernels", "status", "torch ops", "no-page step", "page step", "host syncs",
                         "CUDA launches", "copies", "note"], body)
    dec = stages.get("decode", {}).get("data", {})
    if dec:
        lines += ["", f"decode: workload (b), {dec.get('layers')} layers, batch {dec.get('batch')}, {dec.get('steps')} "
                      f"measured steps after {dec.get('warmup')} warm-up, on {dec.get('device')}, alpha {dec.get('alpha')}:"]
        body = []
        for r in dec.get("rows", []):
            if r.get("status") != "ok":
                body.append([str(r.get("context")), r.get("config", "?"), r.get("kernels", r.get("kernels_choice", "?")),
                             r.get("tier", "?"), r.get("status", "?"), "-", "-", "-", "-", "-",
                             (r.get("reason") or r.get("error") or "")[:80]])
                continue
            body.append([str(r["context"]), r["config"], r.get("kernels", "?"), r["tier"], "ok",
                         _f(r.get("tokens_per_s"), ".2f"), _f(r.get("bytes_per_step_dram", 0) / MIB, ".2f"),
                         _f(r.get("bytes_per_step_ssd", 0) / MIB, ".2f"), _f(r.get("hit_rate"), ".3f"),
                         _f(r.get("step_ms"), ".1f"), f"select {r.get('select_ms', 0):.1f} fetch {r.get('fetch_ms', 0):.1f} "
                                                     f"compute {r.get('compute_ms', 0):.1f} ms"])
        lines += _table(["context", "config", "kernels", "tier", "status", "tok/s", "MiB/step dram", "MiB/step ssd",
                         "hit rate", "step ms", "note"], body)
        for s in dec.get("skipped_contexts", []):
            lines.append(f"  context {s['context']} skipped: {s['reason']}")
        lines += decode_ratios(dec.get("rows", []))
    return "\n".join(lines) + "\n"


def decode_ratios(rows: list[dict]) -> list[str]:
    """KVDrive's tokens/s over the ShadowKV-style baseline's and over dense, per context, kernels and
    tier, and its DRAM+SSD tokens/s over its DRAM ones."""
    tps = {(r["context"], r["config"], r.get("kernels"), r["tier"]): r["tokens_per_s"] for r in rows
           if r.get("status") == "ok"}
    dense = {c: v for (c, name, _, _), v in tps.items() if name == "dense"}
    out = []
    for (context, name, kern, tier), v in tps.items():
        if name != "kvdrive+pipe":
            continue
        parts = []
        base = [x for (c, n, _, t), x in tps.items() if c == context and n == "shadowkv" and t == tier]
        if base:
            parts.append(f"{v / base[0]:.2f}x shadowkv")
        if context in dense:
            parts.append(f"{v / dense[context]:.2f}x dense")
        dram = tps.get((context, name, kern, "dram"))
        if tier == "dram+ssd" and dram:
            parts.append(f"{v / dram:.2f}x its dram row")
        if parts:
            out.append(f"  {context} tokens, kvdrive+pipe ({kern} kernels), {tier}: {v:.2f} tok/s = " + ", ".join(parts))
    return out


def stage_summary(ctx: Context, data: dict) -> None:
    text = render_summary(ctx.results)
    (ctx.out / SUMMARY).write_text(text, encoding="utf-8")
    data["file"] = SUMMARY


# ---------------------------------------------------------------- CLI

STAGES = [
    Stage("env", 0.06, stage_env, isolated=True),
    Stage("gpu_tests", 0.28, stage_gpu_tests),  # 10 tests took 60-70 s on an H200, compiles included
    Stage("micro", 0.12, stage_micro, isolated=True),
    Stage("launches", 0.08, stage_launches, isolated=True),
    Stage("decode", 0.44, stage_decode, isolated=True),
    Stage("summary", 0.02, stage_summary),
]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvdrive.tools.gpu_check",
        description="Measure KVDrive's CUDA path in one run: env, the gpu-marked tests, micro-benchmarks (sparse "
                    "attention, low-rank select, host-to-device copies), decode throughput (dense in HBM, ShadowKV-"
                    "style, KVDrive on DRAM and DRAM+SSD), and a summary. Each stage gets a share of --budget-s "
                    "(env 6%, gpu_tests 20%, micro 20%, decode 52%, summary 2%), records its own errors, and "
                    "results.json is rewritten after every stage. From a source checkout run it as "
                    "'python -m tools.gpu_check'.")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, summary.txt and pytest.log "
                                                           "(created if missing)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds for all stages together (default 480); a stage child still running 10 s past its "
                        "share is killed")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage's plumbing on the CPU: tiny shapes, the reference kernels, a few decode steps; "
                        "what needs CUDA is skipped with the reason recorded")
    p.add_argument("--stages", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="run only these stages, comma-separated (default all: env,gpu_tests,micro,decode; the "
                        "summary always runs)")
    p.add_argument("--tests", nargs="+", default=["tests"], metavar="PATH",
                   help="what the gpu_tests stage hands pytest after '-m gpu' (default: tests)")
    p.add_argument("--decode-contexts", type=_ints, default=[32768, 131072], metavar="N,N",
                   help="decode stage contexts in tokens, in order; a later one runs only if the stage's share is "
                        "estimated to allow it (default 32768,131072; the dry run uses 2048)")
    p.add_argument("--decode-layers", type=int, default=8, help="decode stage layers (default 8, the dry run 1)")
    p.add_argument("--decode-steps", type=int, default=12,
                   help=f"decode stage measured steps after the {DECODE_WARMUP_STEPS} warm-up steps (default 12, the dry run 2 after 2)")
    # A stage in a child process of its own (run_stages starts these).
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = [s.name for s in STAGES]
    if args.stages and set(args.stages) - set(names):
        print(f"gpu_check: --stages: unknown {', '.join(sorted(set(args.stages) - set(names)))}; choose from "
              f"{', '.join(names[:-1])}", file=sys.stderr)
        return 2
    if args.budget_s <= 0 or args.decode_layers < 1 or args.decode_steps < 1 or not args.decode_contexts or \
            any(c < 512 or c % 16 for c in args.decode_contexts):
        print("gpu_check: --budget-s, --decode-layers and --decode-steps must be positive; --decode-contexts "
              "multiples of 16, >= 512", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    shim = ensure_importable()
    if args.stage:
        return _child_main(args)
    selected = None if args.stages is None else set(args.stages) | {"summary"}
    results = {"tool": MODULE, "started_utc": _now(), "budget_s": args.budget_s, "dry_run": args.dry_run,
               "argv": sys.argv[1:] if argv is None else list(argv), "python": sys.executable, "import_shim": shim,
               "source_root": str(source_root()) if source_root() else None}
    ctx = Context(args.out, args.dry_run, time.time() + args.budget_s, args.tests, args.decode_contexts,
                  args.decode_layers, args.decode_steps)
    run_stages(STAGES, ctx, results, args.budget_s, selected, log=lambda s: print(s, flush=True))
    summary = args.out / SUMMARY
    if summary.is_file():
        print()
        print(summary.read_text(encoding="utf-8"), end="", flush=True)
    bad = [n for n, r in results["stages"].items() if r.get("status") not in ("ok", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
