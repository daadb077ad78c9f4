"""After a layer's dense prefill attention: index its pages, store them, seed its device cache."""

from __future__ import annotations

import time

import torch

from kvdrive.kernels import reference as ref
from kvdrive.kernels.window import LocalWindow, ring_capacity
from kvdrive_client.config import AttachConfig
from kvdrive_client.decode.fetch import StoreIO
from kvdrive_client.decode.plan import cache_capacity, first_local_page
from kvdrive_client.decode.state import Context, LayerState
from kvdrive_client.device_cache import DeviceCache
from kvdrive_client.selectors import IndexKind, make_selector


def selector_options(cfg: AttachConfig, head_dim: int) -> dict:
    if cfg.index is IndexKind.HIERARCHICAL:
        return {"pages_per_cluster": cfg.pages_per_cluster, "candidate_factor": cfg.candidate_factor}
    if cfg.index is IndexKind.LOWRANK:
        return {"layout": cfg.lowrank_layout(head_dim), "pages_per_cluster": cfg.pages_per_cluster}
    return {}


def prefill_queries(cfg: AttachConfig) -> int:
    """How many of the prompt's last tokens' queries a prefill reads: the importance's
    ``obs_window`` and, for an index that fits itself to the queries, its fit's. A reused
    prompt runs at least these through the model, so that its index and cache seed are a
    fresh prompt's. At budget 1 every page is attended whatever the index says, so its fit
    does not count: a short prompt still restores its pages."""
    if cfg.budget >= 1 and cfg.budget_tokens is None:
        return cfg.obs_window
    fit = make_selector(cfg.index, cfg.page_size, 1.0).FIT_QUERIES
    return max(cfg.obs_window, fit)


def importance(ctx: Context, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, num_pages: int) -> torch.Tensor:
    """SnapKV-style: attention of the last prompt tokens, summed per page and KV head ``[B, H, P]``."""
    sh = ctx.shape
    # The query rows are the last q_len positions (all of them on a fresh prefill).
    obs = min(ctx.cfg.obs_window, query.shape[2])
    b, h, t, d = keys.shape
    q = query[:, :, query.shape[2] - obs :].reshape(b, h, sh.group, obs, d)
    logits = torch.einsum("bhgod,bhtd->bhgot", q, keys) * sh.scaling
    pos_q = torch.arange(t - obs, t, device=keys.device)
    allowed = (torch.arange(t, device=keys.device)[None, :] <= pos_q[:, None])[None, None, None]
    allowed = allowed & valid[:, None, None, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, ref.NEG_INF).float(), dim=-1).nan_to_num(0.0)
    per_token = probs.sum(dim=(2, 3))  # [B, H, T]
    s = ctx.cfg.page_size
    return per_token[:, :, : num_pages * s].reshape(b, h, num_pages, s).sum(dim=-1)


def _seed_cache(ctx: Context, ls: LayerState, keys, values, score: torch.Tensor, first_local: int) -> None:
    """Fill the cache with the sink pages, then the most important pages before the local window."""
    sink = min(ctx.cfg.sink_pages, first_local)
    n = min(ls.cache.capacity, first_local)
    if n == 0:
        return
    score = score[:, :, :first_local].clone()
    page = torch.arange(first_local, device=score.device)
    start = ctx.first_page[:, None]
    in_sink = (page[None, :] >= start) & (page[None, :] < start + sink)  # a row's sink: its first real pages
    score.masked_fill_(in_sink[:, None, :], float("inf"))  # sink pages always sit in the cache
    score.masked_fill_((page[None, :] < start)[:, None, :], ref.NEG_INF)  # padding pages never do
    top, pages = score.topk(n, dim=2)
    b, h, t, d = keys.shape
    s = ctx.cfg.page_size
    kp = keys[:, :, : first_local * s].reshape(b, h, first_local, s, d)
    vp = values[:, :, : first_local * s].reshape(b, h, first_local, s, d)
    idx = pages[..., None, None].expand(-1, -1, -1, s, d)
    k_seed, v_seed = kp.gather(2, idx), vp.gather(2, idx)
    pages = pages.masked_fill(top == ref.NEG_INF, -1)  # a short row's slots past its pages stay empty
    if ls.cache.head_capacity is not None:  # each head seeds as many pages as its own window holds
        beyond = torch.arange(n, device=pages.device)[None, :] >= ls.cache.head_capacity[:, None]
        pages = pages.masked_fill(beyond[None], -1)
    ls.cache.seed(pages, k_seed, v_seed)


def _index(ctx: Context, ls: LayerState, keys, valid, query) -> torch.Tensor | None:
    """Build the layer's selector over its complete pages; the pages' cluster ids (or None)."""
    cfg, sh = ctx.cfg, ctx.shape
    b, h, t, d = keys.shape
    ls.selector = make_selector(cfg.index, cfg.page_size, sh.scaling, ctx.kernels,
                                **selector_options(cfg, sh.head_dim))
    q = query.reshape(b, h, sh.group, query.shape[2], d)
    if ls.num_pages == 0:
        ls.selector.build(keys[:, :, :0], valid[:, :0], q[:, :, :, :0])
        return None
    return ls.selector.build(keys, valid, q)


def finish_layer(ctx: Context, io: StoreIO, layer: int, query: torch.Tensor, valid: torch.Tensor) -> None:
    """Index, store and cache one layer whose prefill K/V ``ctx.layers[layer].prefill`` holds."""
    t0 = time.perf_counter()
    ls, cfg = ctx.layers[layer], ctx.cfg
    keys, values = ls.prefill
    ls.prefill = None
    b, h, t, d = keys.shape
    s = cfg.page_size
    ls.num_pages = num_pages = t // s
    for ob in ctx.observers:
        ob.on_prefill(layer, keys[:, :, : num_pages * s], valid[:, : num_pages * s])
    cluster = _index(ctx, ls, keys, valid, query)
    t1 = time.perf_counter()
    score = importance(ctx, query, keys, valid, num_pages)
    t2 = time.perf_counter()
    if num_pages:
        io.put_layer(layer, keys, values, num_pages, cluster, score)
    t3 = time.perf_counter()
    first_local = first_local_page(ctx, t, num_pages)
    ls.window = LocalWindow.of(keys[:, :, first_local * s :], values[:, :, first_local * s :], first_local * s,
                               ring_capacity(cfg.local_tokens, s))
    capacity, per_head = cache_capacity(ctx, layer, first_local)
    ls.cache = DeviceCache((b, h, capacity, s, d), keys.dtype, ctx.device, cfg.eviction, reuse=ctx.multiplier != 0,
                           kernels=ctx.kernels)
    ls.cache.set_head_capacity(per_head)
    if ls.cache.reuse:
        _seed_cache(ctx, ls, keys, values, score, first_local)
    t4 = time.perf_counter()
    if layer == len(ctx.layers) - 1:
        io.finish_puts()  # decode fetches only pages the store holds
    if ctx.observers and num_pages:
        sink = min(cfg.sink_pages, first_local)
        ranked = score[:, :, sink:first_local].argsort(dim=2, descending=True, stable=True) + sink
        for ob in ctx.observers:
            ob.on_seed(layer, ranked)
    stats = ctx.stats
    stats["prefill_index_ms"] += (t1 - t0) * 1e3
    stats["prefill_importance_ms"] += (t2 - t1) * 1e3
    stats["prefill_cache_ms"] += (t4 - t3) * 1e3  # the local window, the cache and its seed
    stats["prefill_ms"] += (time.perf_counter() - t0) * 1e3
