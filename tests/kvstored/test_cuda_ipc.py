"""CUDA IPC buffers against a real kvstored: every malformed ``cuda_ipc`` register gets
an error reply naming the problem, a daemon without a usable CUDA device refuses a
well-formed one with ``cuda_unavailable`` ("no CUDA device" and the probe's reason),
and the daemon keeps serving everyone, the refused session included.

The daemon's device path itself (open once, copy gets in and puts out, close at
unregister and at session end) is checked in process over a fake device runtime in
test_cuda_ipc_path.py; the two-process test at the end needs a CUDA device.
"""

from __future__ import annotations

import os
import re
import socket
import struct

import msgpack
import numpy as np
import pytest

from kvdrive.protocol import CUDA_IPC_HANDLE_BYTES, PROTOCOL_VERSION
from kvdrive_client import Geometry
from kvdrive_client.errors import BufferError_, CudaUnavailableError, RequestError
from kvdrive_client.shm import CudaIpcBuffer

GEOM = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=8)
BB = GEOM.block_bytes
HANDLE = bytes(range(CUDA_IPC_HANDLE_BYTES))  # well-formed; names no allocation
GOOD = {"op": "register", "kind": "cuda_ipc", "handle": HANDLE, "device": 0, "offset": 0, "size": 1 << 20}
_UCRED = struct.Struct("3i")


def blocks_of(pages) -> np.ndarray:
    return np.array([(l, h, p) for l in range(GEOM.num_layers) for h in range(GEOM.num_kv_heads) for p in pages], np.int32)


class RawSession:
    """A bare session-socket connection: any message, raw replies."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(10)
        self.sock.connect(path)
        assert self.call({"op": "open"})["ok"]

    def send_raw(self, data: bytes, fds: list[int] | None = None) -> dict:
        if fds:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
        else:
            self.sock.send(data)
        raw = self.sock.recv(4096)
        assert raw, "kvstored closed the session"
        return msgpack.unpackb(raw, raw=False)

    def call(self, msg: dict, fds: list[int] | None = None) -> dict:
        return self.send_raw(msgpack.packb({"v": PROTOCOL_VERSION, **msg}, use_bin_type=True), fds)

    def close(self) -> None:
        self.sock.close()


def with_(**fields) -> dict:
    msg = {**GOOD, **fields}
    return {k: v for k, v in msg.items() if v != "$DROP"}


# Each case: the register message, expected code, message pattern. All are refused
# before the daemon looks at its CUDA devices, on any host.
CASES = {
    "unknown kind": (with_(kind="nvlink"), "bad_field", "buffer kind 'nvlink' is not memfd"),
    "kind an integer": (with_(kind=5), "bad_field", "buffer kind 5 is not"),
    "kind a list": (with_(kind=["cuda_ipc"]), "bad_field", "buffer kind"),
    "kind empty": (with_(kind=""), "bad_field", "buffer kind '' is not"),
    "handle missing": (with_(handle="$DROP"), "bad_field", "'handle' is missing"),
    "handle a string": (with_(handle="x" * 64), "bad_field", "'handle' must be the 64 bytes .* got str"),
    "handle a list": (with_(handle=list(range(64))), "bad_field", "got list"),
    "handle an integer": (with_(handle=7), "bad_field", "got int"),
    "handle nil": (with_(handle=None), "bad_field", "got NoneType"),
    "handle an ext type": (with_(handle=msgpack.ExtType(1, HANDLE)), "bad_field", "got ExtType"),
    "handle empty": (with_(handle=b""), "bad_field", "exactly 64 bytes .* got 0"),
    "handle 63 bytes": (with_(handle=HANDLE[:63]), "bad_field", "exactly 64 bytes .* got 63"),
    "handle 65 bytes": (with_(handle=HANDLE + b"\0"), "bad_field", "exactly 64 bytes .* got 65"),
    "handle 4 KiB-ish": (with_(handle=b"\0" * 3000), "bad_field", "got 3000"),
    "device missing": (with_(device="$DROP"), "bad_field", "'device' is missing"),
    "device a string": (with_(device="0"), "bad_field", "'device' must be an integer"),
    "device a bool": (with_(device=False), "bad_field", "'device' must be an integer"),
    "device negative": (with_(device=-1), "out_of_range", "'device' = -1"),
    "device huge": (with_(device=1 << 40), "out_of_range", "'device' = 1099511627776"),
    "offset missing": (with_(offset="$DROP"), "bad_field", "'offset' is missing"),
    "offset negative": (with_(offset=-4096), "out_of_range", "'offset' = -4096 is outside 0..17592186044416"),
    "offset a float": (with_(offset=0.0), "bad_field", "'offset' must be an integer, got float"),
    "offset a bool": (with_(offset=True), "bad_field", "'offset' must be an integer"),
    "offset 2^64-1": (with_(offset=(1 << 64) - 1), "out_of_range", "'offset' = 18446744073709551615"),
    "offset most negative": (with_(offset=-(1 << 63)), "out_of_range", "'offset' = -9223372036854775808"),
    "size missing": (with_(size="$DROP"), "bad_field", "'size' is missing"),
    "size zero": (with_(size=0), "out_of_range", "'size' = 0 is outside 1.."),
    "size negative": (with_(size=-1), "out_of_range", "'size' = -1"),
    "size past 2^44": (with_(size=(1 << 44) + 1), "out_of_range", "'size' = 17592186044417"),
    "size 2^64-1": (with_(size=(1 << 64) - 1), "out_of_range", "'size'"),
    "size a string": (with_(size="1M"), "bad_field", "'size' must be an integer"),
    "offset plus size overflows": (with_(offset=1 << 44, size=1), "out_of_range", r"'offset' \+ 'size' = 17592186044417 is past 2\^44"),
    "offset plus size just past": (with_(offset=(1 << 43) + 1, size=1 << 43), "out_of_range", "past 2\\^44"),
    # Limits, checked before the devices: one session's cap is 256 GiB (--max-client-buffers).
    "size past the session's limit": (with_(size=300 << 30), "buffer", "limit 274877906944 per session"),
}


@pytest.fixture(scope="module")
def served(module_daemon):
    d = module_daemon
    client = d.client()
    seq = client.create("cuda", "target", GEOM)
    data = np.random.default_rng(0).integers(0, 256, (GEOM.num_layers, GEOM.num_kv_heads, 4, BB), dtype=np.uint8)
    client.put(seq, range(GEOM.num_layers), range(4), data)
    raw = RawSession(str(client._session_path()))
    yield d, client, seq, data, raw
    raw.close()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_cuda_ipc_register_gets_an_error_reply(served, case):
    d, _, _, _, raw = served
    msg, code, pattern = CASES[case]
    reply = raw.call(msg)
    assert reply["ok"] is False, reply
    assert reply["code"] == code, reply
    assert re.search(pattern, reply["error"]), reply["error"]
    assert d.alive()


def test_a_cuda_ipc_register_with_a_descriptor_is_refused_and_the_descriptor_closed(served):
    d, _, _, _, raw = served
    fd = os.memfd_create("stray", os.MFD_ALLOW_SEALING)
    try:
        reply = raw.call(GOOD, [fd])
    finally:
        os.close(fd)
    assert reply["code"] == "buffer" and "carries no file descriptor, got 1" in reply["error"], reply
    # A memfd register without its descriptor is refused as before.
    reply = raw.call({"op": "register", "kind": "memfd", "size": 4096})
    assert reply["code"] == "buffer" and "exactly one file descriptor, got 0" in reply["error"], reply
    assert d.alive()


def test_hello_says_whether_cuda_ipc_is_served(served):
    _, client, _, _, _ = served
    hello = client.hello()
    assert isinstance(hello["cuda_ipc"], bool)
    assert hello["get_seqs"] is True
    assert client.stats()["cuda_ipc"] == hello["cuda_ipc"]


def test_a_driverless_daemon_refuses_a_well_formed_handle_with_its_reason(served):
    d, client, seq, data, raw = served
    if client.hello()["cuda_ipc"]:
        pytest.skip("this daemon can open CUDA IPC handles")
    base = client.stats()["mapped_bytes"]
    reply = raw.call(GOOD)
    assert reply["ok"] is False and reply["code"] == "cuda_unavailable", reply
    assert re.search(r"no CUDA device \(.+\)", reply["error"]), reply["error"]
    # The reason is the probe's, the same one the daemon logged at start-up.
    reason = re.search(r"no CUDA device \((.+)\); register a memfd", reply["error"]).group(1)
    assert f"CUDA IPC buffers: not served, no CUDA device ({reason})" in d.log()
    # Through the SDK's low-level channel the same refusal is its own exception.
    ch = client.session()
    with pytest.raises(CudaUnavailableError, match=r"\[cuda_unavailable\] .*no CUDA device") as err:
        ch._call(GOOD)
    assert err.value.code.value == "cuda_unavailable"
    # And through register_cuda, with a buffer made from raw handle fields.
    with pytest.raises(CudaUnavailableError, match="no CUDA device"):
        client.register_cuda(CudaIpcBuffer(HANDLE, 0, 4096, 1 << 20))
    assert not any(isinstance(b, CudaIpcBuffer) for b in client._buffers)
    # Nothing stays reserved for a refused registration.
    assert client.stats()["mapped_bytes"] == base
    # The refused session goes on: a memfd registers, and gets land in it.
    buf = client.register(16 * BB)
    client.get_into(seq, blocks_of([0, 1]), buf)
    np.testing.assert_array_equal(buf.array[: 8 * BB].reshape(8, BB), data[:, :, :2].reshape(-1, BB))
    client.unregister(buf)
    assert d.alive()


def test_the_daemon_serves_every_client_after_the_refusals(served):
    d, client, seq, data, raw = served
    for _ in range(3):
        raw.call(GOOD)
        raw.call(with_(handle=b"short"))
    other = d.client()
    got = other.get(other.open("cuda", "target"), blocks_of([3]))
    np.testing.assert_array_equal(got, data[:, :, 3].reshape(-1, BB))
    # The raw session, refused a dozen times, still registers a memfd.
    fd = os.memfd_create("ok", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        import fcntl  # noqa: PLC0415

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        reply = raw.call({"op": "register", "size": 4096}, [fd])  # no kind: memfd, as old clients send
        assert reply["ok"] and reply["kind"] == "memfd", reply
        reply = raw.call({"op": "register", "kind": "shm", "size": 4096}, [fd])
        assert reply["ok"] and reply["kind"] == "memfd", reply
    finally:
        os.close(fd)
    assert d.alive()


def test_double_unregister_is_a_not_registered_error(served):
    d, client, _, _, raw = served
    buf = client.register(4096)
    buf_id = buf.buf_id
    ch = client.session()
    ch.unregister(buf_id)
    with pytest.raises(BufferError_, match=f"buffer {buf_id} is not registered by this session"):
        ch.unregister(buf_id)
    with pytest.raises(BufferError_, match="buffer 987654 is not registered"):
        ch.unregister(987654)
    with pytest.raises(RequestError, match=r"\[bad_field\] field 'buf' must be an integer"):
        ch._call({"op": "unregister", "buf": "one"})
    for bad in (None, 1.0, True, b"\x01"):
        reply = raw.call({"op": "unregister", "buf": bad})
        assert reply["code"] == "bad_field", reply
    reply = raw.call({"op": "unregister", "buf": -(1 << 63)})
    assert reply["code"] == "buffer", reply
    client._buffers.remove(buf)  # unregistered by hand above
    buf.close()
    assert client.stats()["sequences"] >= 1
    assert d.alive()


def test_register_cuda_needs_a_cuda_tensor():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        CudaIpcBuffer.from_tensor(torch.zeros(16))
    with pytest.raises(ValueError, match="64 bytes"):
        CudaIpcBuffer(b"\0" * 63, 0, 0, 4096)
    with pytest.raises(ValueError, match="out of range"):
        CudaIpcBuffer(HANDLE, 0, -1, 4096)
    msg, fds = CudaIpcBuffer(HANDLE, 1, 256, 4096).register_message()
    assert msg == {"op": "register", "kind": "cuda_ipc", "handle": HANDLE, "device": 1, "offset": 256, "size": 4096}
    assert fds == []


# ------------------------------------------------------------ on a CUDA host

_GPU_CLIENT = r"""
import sys
import numpy as np
import torch
from kvdrive_client import Geometry, StoreClient

address, out = sys.argv[1], sys.argv[2]
g = Geometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", page_size=8)
bb = g.block_bytes
c = StoreClient(address, timeout=60)
assert c.hello()["cuda_ipc"], c.hello()
seq = c.create("gpu", "s", g)
rng = np.random.default_rng(7)
data = rng.integers(0, 256, (2, 2, 6, bb), dtype=np.uint8)
# A tensor that starts inside its allocation: the registration carries its offset.
whole = torch.zeros(64 * bb + 4096, dtype=torch.uint8, device="cuda")
dev = whole[4096:]
src = torch.from_numpy(data.reshape(-1)).cuda()
buf = c.register_cuda(dev)
assert buf.offset >= 4096, buf
dev[: src.numel()].copy_(src)
torch.cuda.synchronize()
assert c.put_from(seq, range(2), range(6), buf) == 24            # the daemon reads device memory
dev.zero_(); torch.cuda.synchronize()
blocks = np.array([(l, h, p) for l in range(2) for h in range(2) for p in (5, 0, 3)], np.int32)
dst = np.arange(len(blocks), dtype=np.int64)[::-1].copy() * bb
r = c.get_into(seq, blocks, buf, offset=bb, dst=dst)              # into device memory at offset + dst
assert r["n"] == len(blocks), r
got = dev[bb: bb + len(blocks) * bb].cpu().numpy().reshape(-1, bb)[::-1]
want = np.stack([data[l, h, p] for l, h, p in blocks])
np.testing.assert_array_equal(got, want)
c.unregister(buf)
c.close()
open(out, "w").write("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("dram", ["64M", "0"], ids=["dram-hits", "ssd-reads"])
def test_a_cuda_client_puts_and_gets_through_its_device_memory(daemon_factory, tmp_path, dram):
    """Two processes: a CUDA client registers a tensor, puts from it and gets into it
    (from the DRAM tier, or with no DRAM tier from the SSD)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    pytest.importorskip("cupy", reason="CUDA IPC buffers need cupy (the 'gpu' extra) in the client and the daemon")
    daemon = daemon_factory(dram=dram).start()
    if not daemon.client().hello()["cuda_ipc"]:
        pytest.fail(f"torch sees a CUDA device but kvstored does not serve CUDA IPC:\n{daemon.log()}")
    script, out = tmp_path / "gpu_client.py", tmp_path / "ok"
    script.write_text(_GPU_CLIENT)
    run = subprocess.run([sys.executable, str(script), daemon.address, str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr + daemon.log()
    assert out.read_text() == "ok"
    assert daemon.client().stats()["cuda_ipc_handles"] == 0  # closed at unregister
