"""``--ephemeral-dir``: a private directory whose contents go when the daemon stops.

The daemon removes only what it made. Given a directory that does not exist yet, it
creates it (owner-only) and removes it, with everything in it, when it stops. Given an
existing one, which must be empty, it removes only the directories it made inside it
(``--ssd``, and a socket directory below it) and leaves the directory itself, and
anything someone else put there, alone.

Before anything is created, :func:`check` refuses a directory that removing would
harm: ``/``, a mount point, a top-level directory (``/tmp``, ``/home``, ``/var`` ...)
or a well-known system one (``/var/tmp``, the temp root, the runtime directory), any
user's home directory or a directory above one, a symbolic link, a directory of
another user or one others may write, and a directory that is not empty.
:class:`EphemeralDirError` names the option and the fix.

Life cycle: :func:`claim` (check, then create) at start, before the store opens;
:meth:`EphemeralDir.remove` after the daemon has stopped.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvdrive.protocol.address import default_runtime_dir

log = logging.getLogger(__name__)

# System directories below the top level that hold other programs' files.
SYSTEM_DIRS = ("/var/tmp", "/var/lib", "/var/cache", "/var/log", "/var/run", "/usr/local", "/usr/lib",
               "/usr/share", "/run/user", "/dev/shm")
_FIX = "choose a directory of its own that does not exist yet (kvstored creates it and removes it when it stops)"


class EphemeralDirError(RuntimeError):
    """An ``--ephemeral-dir`` the daemon must not remove from; the message says what to choose instead."""


@dataclass(frozen=True)
class _Made:
    """A directory the daemon created, and its identity then (so a replacement is never removed)."""

    path: Path
    dev: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> "_Made":
        st = os.lstat(path)
        return cls(path, st.st_dev, st.st_ino)

    def still_ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (self.dev, self.ino)


@dataclass
class EphemeralDir:
    """The ephemeral directory and what the daemon made in it."""

    root: Path
    made: list[_Made] = field(default_factory=list)

    def make_dirs(self, path: Path) -> None:
        """Create ``path`` (inside the root) and its missing parents, owner-only, recording the topmost one made."""
        path = Path(os.path.realpath(path))
        if not path.is_relative_to(self.root):
            raise EphemeralDirError(f"{path} is not below --ephemeral-dir {self.root}; give --ssd and the sockets "
                                    f"paths below it, without '..' or symbolic links out of it")
        missing = [p for p in [path, *path.parents] if p.is_relative_to(self.root) and not p.exists()]
        for p in reversed(missing):
            p.mkdir(mode=0o700)
        if missing and not any(missing[-1].is_relative_to(m.path) for m in self.made):
            self.made.append(_Made.of(missing[-1]))

    def remove(self) -> None:
        """Remove every directory the daemon made (with what it holds), newest first; nothing else."""
        for made in reversed(self.made):
            if not made.still_ours():
                log.warning("not removing %s: it is no longer the directory kvstored created", made.path)
                continue
            shutil.rmtree(made.path, ignore_errors=True)
            if made.path.exists():
                log.warning("could not remove all of %s, which kvstored created", made.path)
        self.made.clear()


def claim(root: Path, inside: list[Path]) -> EphemeralDir:
    """Check ``root`` (see the module docstring), create it if missing, then the directories ``inside`` it."""
    check(root)
    resolved = Path(os.path.realpath(root))
    eph = EphemeralDir(resolved)
    if not resolved.exists():
        try:
            resolved.mkdir(mode=0o700)
        except OSError as exc:
            raise EphemeralDirError(f"--ephemeral-dir {root}: cannot create it ({exc.strerror or exc}); {_FIX}") from None
        eph.made.append(_Made.of(resolved))
    try:
        for path in inside:
            eph.make_dirs(path)
    except EphemeralDirError:
        eph.remove()
        raise
    except OSError as exc:
        eph.remove()
        raise EphemeralDirError(f"--ephemeral-dir {root}: cannot create {exc.filename} in it "
                                f"({exc.strerror or exc}); {_FIX}") from None
    return eph


def check(root: Path) -> None:
    """Raise :class:`EphemeralDirError` for a directory kvstored must not create or remove things in."""
    resolved = Path(os.path.realpath(root))
    shown = f"--ephemeral-dir {root}" + (f" (that is {resolved})" if resolved != Path(root) else "")
    reason = _harmful(resolved)
    if reason is None and os.path.lexists(root):
        reason = _unusable(Path(root), resolved)
    elif reason is None and not resolved.parent.is_dir():
        reason = f"its parent {resolved.parent} is not a directory kvstored can create it in"
    if reason is not None:
        raise EphemeralDirError(f"{shown} {reason}; {_FIX}")


def _harmful(path: Path) -> str | None:
    """Why removing things in ``path`` could harm the system or a user, or None."""
    if path == Path("/"):
        return "is the root of the filesystem"
    for kind, protected in _protected_dirs():
        if path == protected:
            return f"is {kind}"
        if path in protected.parents and path.parent != Path("/"):
            return f"holds {kind}, {protected}"
    if path.parent == Path("/"):
        return "is a top-level directory of the filesystem"
    if os.path.ismount(path):
        return "is a mount point"
    return None


def _protected_dirs() -> list[tuple[str, Path]]:
    """(what it is, its real path) for every directory an ephemeral directory must not be or hold."""
    out = [("a system directory", Path(os.path.realpath(p))) for p in SYSTEM_DIRS]
    out.append(("the temporary files' directory", Path(os.path.realpath(tempfile.gettempdir()))))
    out.append(("the runtime directory", Path(os.path.realpath(default_runtime_dir()))))
    homes = {entry.pw_dir for entry in pwd.getpwall() if entry.pw_dir}
    if os.environ.get("HOME"):
        homes.add(os.environ["HOME"])
    out.extend(("a user's home directory", Path(os.path.realpath(h))) for h in sorted(homes))
    return out


def _unusable(given: Path, resolved: Path) -> str | None:
    """Why an existing ``given`` cannot be an ephemeral directory, or None."""
    st = os.lstat(given)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    with os.scandir(resolved) as entries:
        first = next(entries, None)
    if first is not None:
        return f"is not empty (it holds {first.name}, which kvstored did not make)"
    return None
