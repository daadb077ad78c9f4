"""kvstored's shape: small files and functions, a store that coordinates parts which never
reach back into it, tiers that know nothing of policy, and no part reading the index's
private state."""

import ast
import re
from pathlib import Path

KVSTORED = Path(__file__).resolve().parents[2] / "kvstored"
MODULES = sorted(KVSTORED.glob("*.py"))
# The parts the store coordinates: each takes the parts it needs, never the store.
PARTS = ["residency", "space", "sequences", "put_path", "get_path", "index", "catalog", "tier", "dram", "ssd"]
TIERS = ["tier", "dram", "ssd"]
POLICY = ["residency", "space", "sequences", "put_path", "get_path", "store", "server", "quota", "dram_shares"]


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _imports(path: Path) -> set[str]:
    """The kvstored modules ``path`` imports (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvstored"):
            found.add(node.module.split(".")[1] if "." in node.module else "")
            if node.module == "kvstored":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kvstored."))
    return found


def test_files_are_short():
    long = {p.name: n for p in MODULES if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"files over 600 lines: {long}"


def test_the_store_is_a_thin_coordinator():
    store = KVSTORED / "store.py"
    n = len(store.read_text().splitlines())
    methods = [f for f in ast.parse(store.read_text()).body if isinstance(f, ast.ClassDef) and f.name == "Store"][0]
    count = sum(isinstance(f, ast.FunctionDef) for f in methods.body)
    assert n <= 300 and count <= 25, f"store.py: {n} lines, Store has {count} methods"


def test_functions_are_short():
    long = {f"{p.name}:{f.name}": f.end_lineno - f.lineno + 1
            for p in MODULES for f in _functions(p) if f.end_lineno - f.lineno + 1 > 60}
    assert not long, f"functions over 60 lines: {long}"


def test_parts_never_import_the_store_or_the_server():
    hits = {p: sorted(_imports(KVSTORED / f"{p}.py") & {"store", "server"}) for p in PARTS}
    assert not any(hits.values()), hits


def test_tiers_know_nothing_of_policy():
    hits = {t: sorted(_imports(KVSTORED / f"{t}.py") & set(POLICY)) for t in TIERS}
    assert not any(hits.values()), hits


def test_the_put_and_get_paths_are_apart():
    assert "get_path" not in _imports(KVSTORED / "put_path.py")
    assert "put_path" not in _imports(KVSTORED / "get_path.py")


def test_every_medium_is_a_tier_in_the_registry():
    from kvstored.dram import DramTier
    from kvstored.ssd import SsdTier
    from kvstored.tier import ROLES, TIERS, Tier

    assert issubclass(DramTier, Tier) and issubclass(SsdTier, Tier)
    assert set(ROLES.values()) <= set(TIERS)


def test_only_the_index_reads_its_private_state():
    hits = [f"{p.name}:{i}" for p in MODULES if p.name != "index.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"index\._by_(uid|name)\b", line)]
    assert not hits, hits


def test_the_daemon_never_imports_the_client_or_torch():
    hits = [f"{p.name}:{i}" for p in MODULES for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"^\s*(import|from) (kvdrive_client|torch)\b", line)]
    assert not hits, hits
