"""Which transformers models KVDrive serves, and the shape and attention kind of their layers."""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from kvdrive_client.errors import KVDriveError
from kvdrive_client.session import ModelShape

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3_text")
GLOBAL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedModelError(KVDriveError, TypeError):
    """The model lacks something KVDrive needs; the message names it."""


def model_shape(model) -> tuple[ModelShape, list[tuple[str, int | None]]]:
    """The shape of the model's global layers (the ones KVDrive stores), and every layer's
    attention kind with its window (None for a global layer)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no .config; attach() takes a transformers model")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; KVDrive supports decoder-only transformers with rotary "
            f"attention whose layers attend globally or over a sliding window: {', '.join(SUPPORTED)}"
        )
    missing = [f for f in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads") if getattr(config, f, None) is None]
    if missing:
        raise UnsupportedModelError(f"model config lacks {', '.join(missing)}")
    kinds = layer_kinds(config)
    layers = attention_modules(model)
    if len(layers) != config.num_hidden_layers:
        raise UnsupportedModelError(f"found {len(layers)} attention modules with layer_idx, config says {config.num_hidden_layers}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"this {model_type} model caps attention logits (attn_logit_softcapping={config.attn_logit_softcapping}); "
            f"KVDrive's sparse attention computes plain softmax attention"
        )
    global_modules = [m for m in layers if kinds[m.layer_idx][0] == GLOBAL]
    scalings = {float(m.scaling) for m in global_modules}
    if len(scalings) > 1:
        raise UnsupportedModelError(f"global layers scale attention differently ({sorted(scalings)}); KVDrive takes one scale")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UnsupportedModelError(f"parameter dtype {dtype} is not float16, bfloat16 or float32")
    scaling = scalings.pop() if scalings else head_dim**-0.5
    shape = ModelShape(len(global_modules), config.num_key_value_heads, config.num_attention_heads, head_dim, dtype, scaling)
    return shape, kinds


def layer_kinds(config) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per layer, as transformers' own caches read the config: ``layer_types``
    where the config has it (hybrid models mix both kinds), else a ``sliding_window`` on every
    layer. Kinds other than global and sliding-window attention are refused by name."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    # Named kinds are checked before transformers reads them: it reads each kind's own fields.
    _refuse_other_kinds(config, getattr(text, "layer_types", None) or [])
    types, kwargs = get_layer_types_and_kwargs(text)
    _refuse_other_kinds(config, types)
    if len(types) != config.num_hidden_layers:
        raise UnsupportedModelError(f"config names {len(types)} layer types for {config.num_hidden_layers} layers")
    kinds = []
    for i, (kind, kw) in enumerate(zip(types, kwargs)):
        window = kw.get("sliding_window") if kind == SLIDING else None
        if kind == SLIDING and not (isinstance(window, int) and window > 0):
            raise UnsupportedModelError(f"layer {i} is a sliding-window layer without a window size ({window!r})")
        kinds.append((kind, window))
    return kinds


def _refuse_other_kinds(config, types) -> None:
    other = sorted({t for t in types if t not in (GLOBAL, SLIDING)})
    if other:
        raise UnsupportedModelError(
            f"layer kind(s) {', '.join(other)} of this {config.model_type} model are not supported; KVDrive decodes "
            f"global attention through the store and keeps sliding-window layers on the device"
        )


def attention_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "scaling")]
