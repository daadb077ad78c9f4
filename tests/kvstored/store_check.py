"""``kvstore-inspect --verify`` on a stopped daemon's store, run in this process.

In-process, not as a command: a Python start that loads numba costs seconds, the check of
a test's store a few milliseconds (tests/kvstored/conftest.py runs it after every test).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from kvdrive.layout.format import META_DIR


def verify_store(ssd: Path) -> None:
    """AssertionError with kvstore-inspect's report if the store at ``ssd`` is damaged;
    nothing to check where no store was made (a daemon that refused to start)."""
    if not (ssd / META_DIR).is_dir():
        return
    from kvdrive.tools.inspect import main  # noqa: PLC0415 - loads numba: only once a store is checked

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(ssd), "--verify"])
    assert status == 0, (f"kvstore-inspect --verify {ssd} exited {status} after the daemon stopped (a test that "
                         f"damages its store on purpose is marked damages_store):\n{out.getvalue()}{err.getvalue()}")
