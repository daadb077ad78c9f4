"""KVDrive's release version, as every command's ``--version`` and the client report it."""

from __future__ import annotations

import argparse
import tomllib
from importlib import metadata
from pathlib import Path


def version() -> str:
    """The installed distribution's version; in a source tree that is not installed, the
    version pyproject.toml states."""
    try:
        return metadata.version("kvdrive")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown (not installed, and no pyproject.toml beside the source)"


def add_version_option(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``PROG VERSION`` and exit."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the KVDrive version and exit")
