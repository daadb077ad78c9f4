"""This repository's folders, imported from its root under their bare names.

The folders install under names of their own (``kernels/`` as ``kvdrive.kernels``,
``client/`` as ``kvdrive_client``, ...: ``[tool.setuptools.package-dir]`` in
pyproject.toml). A Python started in the repository root (``python -m ...``, a shell, a
notebook) has the root first on ``sys.path``, so there ``import kernels`` would find the
folder ``kernels/`` before an installed distribution's top-level ``kernels`` (Hugging
Face's, which transformers imports) and hide it.

So every such folder's ``__init__`` first asks whether it is being imported under its
bare folder name and, if so, calls :func:`step_aside` and runs nothing else: the name
goes to the environment's module of that name, found on ``sys.path`` without this
checkout's root. Where the environment has no such module the folder stays importable
under the bare name as an empty package (its submodules still import, which is how
``python -m tools.gpu_check`` runs from a plain checkout), hiding nothing. ``kvstored/``
installs under its own folder name and needs no guard; ``tests/`` has no ``__init__`` and,
as a namespace folder, never hides a regular package.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["step_aside"]


def step_aside(name: str) -> bool:
    """Hand the top-level name ``name``, whose import found this checkout's folder first, to
    the environment's module of that name; True if there was one to hand it to.

    Call only from the folder's own ``__init__`` while it is being imported as ``name``:
    the import system returns whatever ``sys.modules[name]`` holds when that ``__init__``
    ends, so the importer receives the other module.
    """
    mine = sys.modules[name]
    root = os.path.dirname(os.path.dirname(os.path.realpath(mine.__file__)))
    others = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = _find_elsewhere(name, others)
    if spec is None:
        return False
    theirs = importlib.util.module_from_spec(spec)
    sys.modules[name] = theirs
    try:
        spec.loader.exec_module(theirs)
    except BaseException:
        sys.modules[name] = mine
        raise
    return True


def _find_elsewhere(name: str, path: list[str]) -> importlib.machinery.ModuleSpec | None:
    """The spec a regular module or package ``name`` has outside the checkout, or None.

    Namespace folders (no ``__init__``) are passed over: they never hide anything, and
    ``tests/kernels`` on pytest's path is one."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path if finder is importlib.machinery.PathFinder else None)
        if spec is not None and spec.loader is not None and spec.has_location:
            return spec
    return None
