"""Whatever comes back on the socket, the client raises its own errors, never the daemon's."""

import threading

import msgpack
import pytest
import zmq

from kvdrive_client.errors import RequestError, StoreError
from kvdrive_client.store import StoreClient


@pytest.mark.parametrize("reply", [b"\xc1 not msgpack", msgpack.packb({"v": 99, "id": 1, "ok": True}),
                                   msgpack.packb([1, 2, 3])])
def test_a_reply_of_another_protocol_is_a_client_error(tmp_path, reply):
    address = f"ipc://{tmp_path / 'fake.sock'}"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)

    def answer() -> None:
        if router.poll(10_000):
            ident, *_ = router.recv_multipart()
            router.send_multipart([ident, reply])

    t = threading.Thread(target=answer)
    t.start()
    client = StoreClient(address, timeout=10)
    try:
        with pytest.raises(RequestError, match="kvstored at ipc://") as err:
            client.hello()
        assert isinstance(err.value, StoreError) and type(err.value).__module__.startswith("kvdrive_client")
    finally:
        t.join()
        client.close()
        router.close(linger=0)
        ctx.term()


def test_every_sdk_error_has_one_root():
    from kvdrive_client import KVDriveError, UnsupportedModelError
    from kvdrive_client import errors
    from kvdrive_client.profile import ProfileError

    store_errors = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(store_errors) > 10
    for cls in store_errors + [UnsupportedModelError, ProfileError]:
        assert issubclass(cls, KVDriveError), cls
