"""Every kvstored test leaves a sound store behind: ``kvstore-inspect --verify`` runs on the
store directory of each daemon the test started, once that daemon has stopped (or been
killed: a crash must leave a sound store too), and damage fails the test.

A test that damages a store on purpose says so with ``@pytest.mark.damages_store``. A
daemon shared by a module's tests (``module_daemon``) is not checked, nor is a directory
in which no store was made (a daemon that refused to start).
"""

from __future__ import annotations

import pytest

from store_check import verify_store


def pytest_configure(config):
    config.addinivalue_line("markers", "damages_store: the test damages a store on purpose; its stores are not verified")


def _verify(d) -> None:
    verify_store(d.ssd)


@pytest.fixture(autouse=True)
def verified_stores(request, daemon_process):
    """Verify the stores of the daemons this test started: each as it stops, and at the end
    those that stopped by themselves (the fixtures that kill what is left end before this one)."""
    if request.node.get_closest_marker("damages_store") is not None:
        yield
        return
    first = len(daemon_process.started)
    daemon_process.after_exit = _verify
    try:
        yield
        for d in daemon_process.started[first:]:
            if not d.alive() and not d.checked:
                d.checked = True
                verify_store(d.ssd)
    finally:
        daemon_process.after_exit = None
        del daemon_process.started[first:]
