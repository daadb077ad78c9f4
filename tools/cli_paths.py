"""Argument types for the paths a tool makes or writes: checked when its command line is
read, so that a run of minutes does not end in a traceback over a path it could have refused."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def work_dir(text: str) -> Path:
    """A benchmark's ``--dir``: made, with its parents, where it does not exist yet; a usage
    error, in one line, where it is not a directory or cannot be made."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make {text}: {exc.strerror or exc}") from None
    return path


def output_file(text: str) -> Path:
    """A file a tool writes at its end (a bench's ``--json FILE``, ``--png FILE``),
    checked before the run rather than after it: its directory made where missing, a usage
    error where the file could not be written there (not a directory, no permission, FILE a
    directory)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name the file to write")
    work_dir(str(path.parent))
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return path
