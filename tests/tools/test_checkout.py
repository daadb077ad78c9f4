"""No folder of the repository hides another distribution's top-level module from a Python
started in the repository root (kvdrive.tools.checkout)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def _top_level_names() -> list[str]:
    """What a Python started in the root can import by a bare name from the root itself:
    folders with an ``__init__`` and ``.py`` files."""
    names = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    names += [p.stem for p in ROOT.iterdir() if p.is_file() and p.suffix == ".py"]
    return sorted(names)


def _python(code: str, *flags: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # the root must be on sys.path, as in a shell started there
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_root_name_is_its_installed_name_or_steps_aside():
    """A root folder that installs under its own name (kvstored/) is that module wherever it is
    imported from; every other importable root name must be one that steps aside."""
    dirs = _package_dirs()
    same_name = {folder for name, folder in dirs.items() if name == folder}
    assert same_name == {"kvstored"}
    for name in _top_level_names():
        if name in same_name:
            continue
        assert name in dirs.values(), (f"{name}: a root folder or file importable as the top-level {name!r} that is "
                                       "not one of pyproject.toml's package folders")
        init = (ROOT / name / "__init__.py").read_text()
        assert f'if __name__ == "{name}":' in init and "step_aside(__name__)" in init, name


@pytest.mark.parametrize("flags", [(), ("-S",)], ids=["installed", "plain-checkout"])
def test_an_installed_module_of_a_root_folders_name_wins(tmp_path, flags):
    """Other distributions' top-level packages named as the root folders, on the path after
    the root (as site-packages is): each import by that name from the root gets theirs. With
    -S (no site-packages, so no KVDrive installed) the guards need nothing but the checkout."""
    names = [n for n in _top_level_names() if n != "kvstored"]
    assert {"kernels", "tools", "layout", "protocol", "client"} <= set(names)
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"ORIGIN = 'other distribution'\nNAME = {name!r}\n")
        (tmp_path / name / "part.py").write_text("WHO = 'theirs'\n")
    code = ("import sys\nassert sys.path[0] == '', sys.path[:3]\n"
            f"for name in {names!r}:\n"
            "    m = __import__(name)\n"
            "    assert getattr(m, 'ORIGIN', None) == 'other distribution', (name, m)\n"
            "    assert __import__(name + '.part', fromlist=['WHO']).WHO == 'theirs', name\n"
            "print('ok')\n")
    proc = _python(code, *flags, pythonpath=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_root_folder_with_no_other_module_of_its_name_stays_importable():
    """Where nothing else has the name, the bare name is the folder, empty, and its submodules
    import (``python -m tools.gpu_check`` from a plain checkout relies on it)."""
    proc = _python("import tools, tools.checkout, layout\n"
                   "assert tools.__file__.startswith(%r), tools.__file__\n"
                   "assert not hasattr(layout, 'Geometry')\n"
                   "print('ok')" % str(ROOT))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_transformers_and_kvdrive_import_in_the_root_beside_hf_kernels():
    """transformers 5.25 imports the Hugging Face ``kernels`` package from modeling_utils; in
    the root, ``kernels/`` once shadowed it."""
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Hugging Face kernels package is not installed here (the lock installs it)")
    proc = _python("import transformers.modeling_utils, kvdrive_client, kvdrive.kernels, kernels\n"
                   "from kvdrive.kernels import for_device\n"
                   "print(kernels.__file__)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not Path(proc.stdout.strip()).resolve().is_relative_to(ROOT / "kernels"), proc.stdout
