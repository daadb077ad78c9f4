"""The fidelity corpus: real text of several kinds, found on this machine.

None of it is the licence texts the selectors' settings were chosen on. Each kind is the
concatenation of files a Debian machine with Python and CMake has (the first
``MAX_CHARS`` characters), in a fixed order, so two runs on such machines read the same
text:

- ``code``: Python's standard library source;
- ``reference``: CMake's reference manuals (reStructuredText, full of option tables and
  repeated signatures);
- ``tabular``: the time zone database's rule and zone tables (``tzdata.zi``);
- ``log``: dpkg's and update-alternatives' logs (near-identical lines by the thousand);
- ``changelog``: Debian package changelogs (short entries of prose in a fixed frame).

``--corpus DIR`` reads one's own instead: each file of DIR, or each subdirectory (its
files concatenated in name order), is a kind named after it.
"""

from __future__ import annotations

import glob
import gzip
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAX_CHARS = 600_000  # per kind: far more than 4 windows of 8K tokens of any of them
MIN_CHARS = 20_000


@dataclass(frozen=True)
class Kind:
    name: str
    description: str
    files: Callable[[], list[Path]]


def _stdlib() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = ("argparse.py", "typing.py", "inspect.py", "pathlib.py", "subprocess.py", "tarfile.py", "dataclasses.py",
             "functools.py", "configparser.py", "enum.py")
    return [lib / n for n in names if (lib / n).is_file()]


def _glob(*patterns: str) -> Callable[[], list[Path]]:
    return lambda: [Path(p) for pattern in patterns for p in sorted(glob.glob(pattern)) if Path(p).is_file()]


KINDS = (
    Kind("code", "Python standard library source", _stdlib),
    Kind("reference", "CMake reference manuals (reStructuredText)", _glob("/usr/share/cmake-*/Help/manual/*.rst")),
    Kind("tabular", "time zone rule and zone tables (tzdata.zi)", _glob("/usr/share/zoneinfo/tzdata.zi")),
    Kind("log", "dpkg and update-alternatives logs", _glob("/var/log/dpkg.log", "/var/log/alternatives.log")),
    Kind("changelog", "Debian package changelogs", _glob("/usr/share/doc/*/changelog.Debian.gz")),
)


def _read(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def _join(files: list[Path]) -> str:
    parts, size = [], 0
    for f in files:
        if size >= MAX_CHARS:
            break
        text = _read(f)
        parts.append(text)
        size += len(text)
    return "\n\n".join(parts)[:MAX_CHARS]


def default_corpus() -> tuple[dict[str, str], dict[str, str]]:
    """(kind -> text, kind -> why it was left out) for the kinds above on this machine."""
    texts, missing = {}, {}
    for kind in KINDS:
        files = kind.files()
        text = _join(files) if files else ""
        if len(text) < MIN_CHARS:
            missing[kind.name] = f"{kind.description}: {len(files)} files, {len(text)} characters here"
        else:
            texts[kind.name] = text
    return texts, missing


def corpus_from_dir(path: Path) -> dict[str, str]:
    """Each file of ``path``, or each subdirectory's files concatenated in name order, as a kind
    named after it; ValueError for a directory that holds none."""
    if not path.is_dir():
        raise ValueError(f"--corpus {path} is not a directory")
    texts = {}
    for entry in sorted(path.iterdir()):
        files = sorted(p for p in entry.rglob("*") if p.is_file()) if entry.is_dir() else [entry]
        text = _join(files)
        if text.strip():
            texts[entry.stem if entry.is_file() else entry.name] = text
    if not texts:
        raise ValueError(f"--corpus {path} holds no text files")
    return texts
