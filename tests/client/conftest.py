import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny(kind: str = "qwen2", layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


@pytest.fixture
def int16_lowrank(monkeypatch):
    """The CPU kernels' low-rank scores by their int16 passes, not by VNNI's int8 weights
    (``kvdrive.kernels.cpu.lowrank_vnni``, on hosts that have it): for tests that hold two
    kernel sets to the same pages, which the int8 weights' coarser rounding may swap at a
    near tie (their scores' bounds are checked in tests/kernels)."""
    monkeypatch.setenv("KVDRIVE_LOWRANK_VNNI", "0")


@pytest.fixture
def make_tiny():
    return tiny


@pytest.fixture
def tiny_qwen2():
    return tiny("qwen2")


@pytest.fixture
def tiny_llama():
    return tiny("llama")


@pytest.fixture(scope="session")
def smollm2():
    from kvdrive_client.models import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def license_ids(smollm2):
    from kvdrive_client.models import license_text

    _, tok = smollm2
    return tok(license_text(), return_tensors="pt").input_ids[0]


@pytest.fixture(scope="session")
def gemma3():
    from kvdrive_client.models import load_gemma3

    return load_gemma3()
