"""The lower-level API against plain dense attention."""

import torch

from kvdrive_client.engine import ModelShape, SparseKV


def dense(q, k, v, valid, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", q, k) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", torch.softmax(logits, -1), v)


def test_full_budget_decode_equals_dense_attention(daemon):
    g = torch.Generator().manual_seed(0)
    B, H, HQ, D, T, L = 2, 2, 4, 32, 200, 2
    keys = [torch.randn(B, H, T, D, generator=g) for _ in range(L)]
    values = [torch.randn(B, H, T, D, generator=g) for _ in range(L)]
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :37] = False  # row 1 is left-padded
    with daemon.client() as store:
        kv = SparseKV(store, ModelShape(L, H, HQ, D, torch.float32), batch=B, budget=1.0)
        for layer in range(L):
            kv.prefill(layer, torch.randn(B, HQ, T, D, generator=g), keys[layer], values[layer], valid)
        for _ in range(40):
            valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool)], dim=1)
            for layer in range(L):
                q, k, v = torch.randn(B, HQ, D, generator=g), torch.randn(B, H, D, generator=g), torch.randn(B, H, D, generator=g)
                keys[layer] = torch.cat([keys[layer], k[:, :, None]], dim=2)
                values[layer] = torch.cat([values[layer], v[:, :, None]], dim=2)
                out = kv.decode(layer, q, k, v)
                torch.testing.assert_close(out, dense(q, keys[layer], values[layer], valid, D**-0.5), atol=1e-5, rtol=1e-5)
        shift = -T % 16  # KVDrive's padding before the prompt: its pages end where it does
        assert kv.stats["pages_flushed"] == (shift + T + 40) // 16 - (shift + T) // 16
        kv.close()


def test_decode_runs_its_torch_ops_on_one_thread(daemon, monkeypatch):
    """The local-window append and the attention of a decode step use one intra-op thread
    (split ops wait for a core the kernels, the daemon or the front thread hold); the
    caller's thread count is back afterwards."""
    g = torch.Generator().manual_seed(1)
    B, H, HQ, D, T = 2, 2, 4, 32, 96
    threads = torch.get_num_threads()
    seen = []
    cat = torch.cat

    def counting_cat(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return cat(*args, **kwargs)

    with daemon.client() as store:
        kv = SparseKV(store, ModelShape(1, H, HQ, D, torch.float32), batch=B, budget=0.25)
        kv.prefill(0, torch.randn(B, HQ, T, D, generator=g), torch.randn(B, H, T, D, generator=g),
                   torch.randn(B, H, T, D, generator=g))
        torch.set_num_threads(2)
        try:
            monkeypatch.setattr(torch, "cat", counting_cat)
            for _ in range(3):
                kv.decode(0, torch.randn(B, HQ, D, generator=g), torch.randn(B, H, D, generator=g),
                          torch.randn(B, H, D, generator=g))
            monkeypatch.undo()
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(threads)
        kv.close()
    assert len(seen) >= 6 and set(seen) == {1}  # at least the two appends per step
