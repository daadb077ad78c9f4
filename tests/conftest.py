"""Shared fixtures: real kvstored processes on private sockets in temp directories."""

from __future__ import annotations

import ctypes.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

# Without a CUDA driver, Triton's kernels run under its interpreter (on CPU tensors), which
# triton chooses once, at its first import: set it before anything imports triton or torch.
if ctypes.util.find_library("cuda") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_device_calls_once_per_launch() -> None:
    """Triton's interpreter patches the language modules a kernel sees at each launch, and
    again at every call of a ``@triton.jit`` helper inside it, though those modules are
    patched already; in kernels that call helpers in loops that repeated patching was a
    quarter of an interpreted launch. Inside a launch, a helper call now patches only the
    modules the launch has not (the helper runs exactly as before); outside one, as before."""
    try:
        from triton import language as tl  # noqa: PLC0415
        from triton.runtime import interpreter  # noqa: PLC0415
    except ImportError:
        return
    launch_call = getattr(interpreter.GridExecutor, "__call__", None)
    device_call = getattr(interpreter.InterpretedFunction, "__call__", None)
    if launch_call is None or device_call is None or not hasattr(interpreter, "_patch_lang"):
        return
    patched: list[set | None] = [None]  # ids of the modules the innermost launch has patched

    def langs(fn) -> set:  # the modules _patch_lang(fn) patches
        return {id(v) for v in fn.__globals__.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}

    def launch(self, *args, **kwargs):
        outer, patched[0] = patched[0], langs(self.fn)
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched[0] = outer

    def call(self, *args, **kwargs):
        done = patched[0]
        if done is None:
            return device_call(self, *args, **kwargs)
        need = langs(self.fn)
        if not need <= done:
            interpreter._patch_lang(self.fn)
            done |= need
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call


def _interpret_xor_reductions_with_numpy() -> None:
    """Triton's interpreter reduces with numpy where the combine function is one of its own
    max, min, argmax, argmin or sum, and otherwise calls the combine function element by
    element in Python. ``tl.sort`` (the Triton kernels' page choice and placement) swaps
    pairs by an xor reduction over a hypercube of the keys, which fell to that loop: an
    interpreted decode of a tiny model took 43.9 s with it, 27.8 s without. Integer xor is
    associative and commutative, so ``np.bitwise_xor.reduce`` gives the same bits; the sort
    itself still runs as Triton writes it."""
    try:
        import numpy as np  # noqa: PLC0415
        from triton import language as tl  # noqa: PLC0415
        from triton.runtime import interpreter  # noqa: PLC0415
    except ImportError:
        return
    xor = getattr(tl.standard, "_xor_combine", None)
    apply_impl = getattr(getattr(interpreter, "ReduceOps", None), "apply_impl", None)
    if xor is None or apply_impl is None or not hasattr(interpreter.ReduceOps, "to_tensor"):
        return

    def reduce(self, input):
        if self.combine_fn == xor and len(input) == 1 and input[0].dtype.scalar.is_int():
            x = input[0]
            return self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims),
                                  x.dtype.scalar)
        return apply_impl(self, input)

    interpreter.ReduceOps.apply_impl = reduce


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_device_calls_once_per_launch()
    _interpret_xor_reductions_with_numpy()

from kvdrive_client import StoreClient  # noqa: E402


class DaemonProcess:
    """One kvstored process over a store directory; can be stopped, killed, restarted.

    ``after_exit``, when set, is called with the daemon each time it has been stopped or
    killed here (tests/kvstored checks its store then); ``started`` lists every daemon
    started, in order.
    """

    after_exit: Callable[["DaemonProcess"], None] | None = None
    started: list["DaemonProcess"] = []

    def __init__(self, root: Path, dram: str = "64M", ssd_max: str = "4G", extra: list[str] | None = None) -> None:
        self.root = root
        self.ssd = root / "ssd"
        self.address = f"ipc://{root / 'kvstored.sock'}"
        self.dram, self.ssd_max, self.extra = dram, ssd_max, list(extra or [])
        self.proc: subprocess.Popen | None = None
        self.log_path = root / "kvstored.log"
        self._clients: list[StoreClient] = []

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        cmd = [sys.executable, "-m", "kvstored", "--ssd", str(self.ssd), "--dram", self.dram, "--ssd-max",
               self.ssd_max, "--listen", self.address, *self.extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.checked = False  # by after_exit, since this start
        DaemonProcess.started.append(self)
        probe = StoreClient(self.address, timeout=5)
        deadline = time.monotonic() + timeout
        try:
            while not probe.ping(timeout=0.5):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvstored exited with {self.proc.returncode}:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kvstored did not answer within {timeout} s:\n{self.log()}")
        finally:
            probe.close()
        return self

    def client(self, timeout: float = 60.0) -> StoreClient:
        c = StoreClient(self.address, timeout=timeout)
        self._clients.append(c)
        return c

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _close_clients(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:  # a client the test already closed
                pass
        self._clients.clear()

    def stop(self, timeout: float = 30.0) -> int:
        self._close_clients()
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout)
        self._exited()
        return self.proc.returncode

    def kill9(self) -> None:
        self._close_clients()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._exited()

    def _exited(self) -> None:
        if DaemonProcess.after_exit is not None and not self.checked:
            self.checked = True
            DaemonProcess.after_exit(self)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A temp root of this run's own, shorter than pytest's: a Unix socket's path may be at
    most 107 bytes, the daemons of the tests put theirs a few directories into ``tmp_path``,
    and pytest-xdist (``pytest -n 2``) adds a directory per worker (``popen-gwN``) below
    pytest's ``$TMPDIR/pytest-of-USER/pytest-N``. The deepest socket a test makes is 104
    bytes long below ``/tmp/kvt-XXXXXXXX/popen-gwN`` (a bench's own directory in
    ``tmp_path``), so the root goes in ``/tmp`` even where ``$TMPDIR`` is set longer.
    Removed after a run that passed, kept (and named) after one that did not."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        parent = tempfile.gettempdir()
        if len(parent) > len("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
            parent = "/tmp"
        config.option.basetemp = config._kvdrive_basetemp = tempfile.mkdtemp(prefix="kvt-", dir=parent)
    if hasattr(config, "workerinput"):
        # A worker's torch ops on its share of the cores: two workers each on the host's every
        # core only took turns, their OpenMP threads spinning while the other's ran.
        import torch  # noqa: PLC0415

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput["workercount"])))


def pytest_sessionfinish(session, exitstatus):
    root = getattr(session.config, "_kvdrive_basetemp", None)
    if root is None:
        return
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"\nthe tests' temp directories are kept in {root}", file=sys.stderr)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped, with the reason, where torch sees none."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    try:
        import torch  # noqa: PLC0415 - only when a gpu test was collected

        usable = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a torch without CUDA support, or a broken install
        usable = False
    if usable:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is false")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture
def daemon_process() -> type[DaemonProcess]:
    """The class of the daemons these fixtures start: its ``after_exit`` hook, its ``started`` list."""
    return DaemonProcess


@pytest.fixture
def daemon_at():
    """Daemons over directories the test chose (one other users can reach, say); killed at the end."""
    made: list[DaemonProcess] = []

    def make(root: Path, **kwargs) -> DaemonProcess:
        d = DaemonProcess(root, **kwargs)
        made.append(d)
        return d

    yield make
    for d in made:
        if d.alive():
            d.kill9()


@pytest.fixture
def daemon_factory(tmp_path, daemon_at):
    """Daemons each in a fresh directory under the test's temp dir."""
    count = itertools.count()

    def make(**kwargs) -> DaemonProcess:
        root = tmp_path / f"d{next(count)}"
        root.mkdir()
        return daemon_at(root, **kwargs)

    return make


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory().start()


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory) -> DaemonProcess:
    """One daemon shared by a module's tests, for long tables of independent requests."""
    d = DaemonProcess(tmp_path_factory.mktemp("daemon")).start()
    yield d
    if d.alive():
        d.kill9()
