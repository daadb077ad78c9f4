"""The SDK says its version, and every public call of it says what it does."""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

import kvdrive_client
from kvdrive_client import StoreClient, attach, connect
from kvdrive_client.engine import SparseKV
from kvdrive_client.handle import Handle

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_distributions():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert kvdrive_client.__version__ == version("kvdrive") == pyproject


def public(cls) -> list[str]:
    return [n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]


@pytest.mark.parametrize("obj", [
    connect, attach, StoreClient, Handle, SparseKV,
    *(getattr(StoreClient, n) for n in public(StoreClient)),
    *(getattr(Handle, n) for n in public(Handle)),
    *(getattr(SparseKV, n) for n in public(SparseKV)),
], ids=lambda o: getattr(o, "__qualname__", None) or getattr(o.fget, "__qualname__", repr(o)))
def test_public_api_is_documented(obj):
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
    assert doc and len(doc) > 20, f"{obj} has no docstring worth the name"
