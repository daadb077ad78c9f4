"""What a person sees while KVDrive prepares a machine on its first use.

The first ``attach()`` on a machine compiles the CPU kernels (about a minute on a 2-core
host; later ones load them in under a second). Those steps are logged at INFO, which a
program that never configured logging does not show, so a first attach() looked hung.
:class:`KernelNotice` says it on stderr instead where logging is not configured (and
only when a compile actually happens): a first line once the warm-up has run 2 s, then
one line per kernel compiled. Where logging is configured, the INFO lines say it all.
The first load of a model converts its GGUF file the same way (:func:`tell`, from
:mod:`kvdrive_client.models`).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the kernels import torch and numba: models.py tells its lines without them
    from kvdrive.kernels import KernelProgress

log = logging.getLogger(__name__)

FIRST_LINE_AFTER_S = 2.0


def logging_configured() -> bool:
    """Whether this program set up logging (a handler on the root or on kvdrive's loggers)."""
    return bool(logging.getLogger().handlers or logging.getLogger("kvdrive_client").handlers
                or logging.getLogger("kvdrive").handlers)


def tell(message: str, level: int = logging.INFO, logger: logging.Logger = log) -> None:
    """``message`` on stderr where logging is not configured; logged at ``level`` (by ``logger``) where it is."""
    if logging_configured():
        logger.log(level, "%s", message)
    else:
        print(f"kvdrive: {message}", file=sys.stderr, flush=True)


class KernelNotice:
    """A :func:`kvdrive.kernels.warm_up` ``progress`` that tells a person about compiles."""

    def __init__(self) -> None:
        self._timer: threading.Timer | None = None
        self._told = False

    def __call__(self, p: KernelProgress) -> None:
        if p.seconds is None:
            if p.index == 1 and not logging_configured():
                self._timer = threading.Timer(FIRST_LINE_AFTER_S, self._first_line)
                self._timer.daemon = True
                self._timer.start()
            return
        if p.compiled and not logging_configured():
            self._first_line()
            tell(f"compiled the {p.kernel} kernel in {p.seconds:.1f} s ({p.index}/{p.total})")
        if p.index == p.total:
            self.close()

    def _first_line(self) -> None:
        if not self._told:
            self._told = True
            tell("compiling the CPU kernels for this machine, once (about a minute on a 2-core host; "
                 "later attach() calls load them in under a second)")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
