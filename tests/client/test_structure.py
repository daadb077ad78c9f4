"""The client's shape: small files and functions on the decode path, one module deciding by device."""

import ast
import re
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"
# What runs a decode step: the cache hooks, the session and its stages, selection, the device cache.
DECODE_PATH = ["hooks.py", "handle.py", "architecture.py", "engine.py", "session.py", "device_cache.py", "selectors.py", "selector_base.py", "lowrank.py",
               *[f"decode/{p.name}" for p in sorted((CLIENT / "decode").glob("*.py"))]]


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_decode_path_files_are_short():
    long = {p: n for p in DECODE_PATH if (n := len((CLIENT / p).read_text().splitlines())) > 300}
    assert not long, f"files over 300 lines: {long}"


def test_client_functions_are_short():
    long = {f"{p.relative_to(CLIENT)}:{f.name}": f.end_lineno - f.lineno + 1
            for p in CLIENT.rglob("*.py") for f in _functions(p) if f.end_lineno - f.lineno + 1 > 60}
    assert not long, f"functions over 60 lines: {long}"


def test_decode_path_functions_take_at_most_six_parameters():
    many = {}
    for p in DECODE_PATH:
        for f in _functions(CLIENT / p):
            a = f.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            if len(names) > 6:
                many[f"{p}:{f.name}"] = len(names)
    assert not many, f"functions with more than 6 parameters: {many}"


def test_the_client_never_imports_the_daemon():
    hits = [f"{p.relative_to(CLIENT)}:{i}" for p in CLIENT.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\b(import|from) kvstored\b", line)]
    assert not hits, hits


def test_no_device_branches_in_the_decode_path():
    """The kernels are chosen once per device (kvdrive.kernels.for_device); the client never asks."""
    hits = [f"{p}:{i}" for p in DECODE_PATH for i, line in enumerate((CLIENT / p).read_text().splitlines(), 1)
            if re.search(r"\.type\s*[!=]=|device\.type", line)]
    assert not hits, hits


def test_every_client_module_imports_first():
    """Each module imports in an interpreter that has imported no other client module (an
    import cycle fails only for the module a user happens to import first)."""
    import subprocess
    import sys

    names = sorted("kvdrive_client." + ".".join(p.relative_to(CLIENT).with_suffix("").parts)
                   for p in CLIENT.rglob("*.py") if p.name != "__init__.py")
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.startswith('kvdrive_client')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as e:\n"
        "        failed.append(f'{name}: {e}')\n"
        "print('\\n'.join(failed))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not out.stdout.strip(), out.stdout
