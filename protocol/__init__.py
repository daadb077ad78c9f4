"""kvdrive.protocol: the wire protocol between kvstored and its clients (:mod:`kvdrive.protocol.wire`),
and where a client finds the daemon (:mod:`kvdrive.protocol.address`)."""

if __name__ == "protocol":  # imported from the repository root by its bare folder name: see tools/checkout.py
    from tools.checkout import step_aside

    step_aside(__name__)
else:
    from kvdrive.protocol.wire import *  # noqa: F403 (the package's names are the wire module's)
    from kvdrive.protocol.wire import __all__  # noqa: F401
