"""attach() compiles the CPU kernels up front: nothing is left to compile on the decode path.

The deterministic form of "the first decode step is as fast as a warm one": in a process
with an empty kernel cache, no numba dispatcher gains a signature between attach() and
the end of a real decode. Compiling the kernels from nothing takes about a minute on a
2-core host; the compile runs once, in the module's first process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvdrive.kernels
from kvdrive.kernels import compiles_on_cpu, warm_up
from kvdrive.protocol import jit_cache
from kvdrive.kernels.reference import SketchLayout
from kvdrive.kernels.warmup import _cases

KERNELS_DIR = Path(kvdrive.kernels.__file__).parent

# attach() and a short decode of a tiny model per dtype, through the given daemon; prints
# the new signatures per dispatcher, the warm-up's log and where the kernels were cached.
DECODE_PROBE = r"""
import json, logging, sys
import torch
from numba.core.registry import CPUDispatcher
from transformers import LlamaConfig, LlamaForCausalLM
from kvdrive.kernels import cpu
from kvdrive_client import attach

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
warmup_log = logging.getLogger("kvdrive.kernels.warmup")
warmup_log.addHandler(Keep())
warmup_log.setLevel(logging.INFO)

def signatures():  # every dispatcher of every module of the package (the generated logit passes included)
    modules = [m for name, m in sys.modules.items() if name == cpu.__name__ or name.startswith(cpu.__name__ + ".")]
    return {f"{m.__name__}.{n}": set(map(str, d.signatures))
            for m in modules for n, d in vars(m).items() if isinstance(d, CPUDispatcher)}

decodes = []
for dtype, lengths in ((torch.float32, (700, 500)), (torch.bfloat16, (700,))):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval().to(dtype)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):  # left padding
        ids[row, t - n:] = torch.randint(1, 512, (n,))
        mask[row, t - n:] = 1
    handle = attach(model, sys.argv[1], budget=0.1, kernels="cpu")
    before = signatures()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                       pad_token_id=0)
    stats = handle.stats()
    handle.detach()
    after = signatures()
    decodes.append({"dtype": str(dtype), "steps": stats.get("steps", 0), "selected": stats.get("select_ms", 0) > 0,
                    "new": {n: sorted(after[n] - before.get(n, set())) for n in after if after[n] - before.get(n, set())}})
print(json.dumps({"decodes": decodes, "log": lines, "cache_path": cpu._place.stats.cache_path}))
"""

WARM_PROBE = r"""
import json, torch
from kvdrive.kernels import warm_up
from kvdrive_client.config import AttachConfig
from kvdrive_client.lowrank import fitted_layout
layout = fitted_layout(AttachConfig().lowrank_layout(32), 32)  # the decode probe's model: head dim 32
r = warm_up(dtypes=(torch.float32, torch.bfloat16), indexes=("lowrank",), layouts=(layout,))
print(json.dumps({"compiled": r.compiled, "loaded": r.loaded, "summary": r.summary}))
"""


def numba_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("**/*") if p.suffix in (".nbi", ".nbc")}


def fresh_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["KVDRIVE_CACHE"] = str(cache)
    return env


def run_probe(script: str, env: dict, *argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, module_daemon):
    """A process with an empty kernel cache: attach() and a decode per dtype, the source tree watched."""
    cache = tmp_path_factory.mktemp("kvdrive-cache")
    beside_sources = numba_files(KERNELS_DIR)
    result = run_probe(DECODE_PROBE, fresh_env(cache), module_daemon.address)
    return cache, result, beside_sources


def test_no_kernel_compiles_during_a_decode_after_attach(first_run):
    _, result, _ = first_run
    for decode in result["decodes"]:
        assert decode["steps"] > 0 and decode["selected"], decode
        assert decode["new"] == {}, f"{decode['dtype']} decode compiled after attach(): {decode['new']}"


def test_attach_says_what_it_compiled_and_the_kernels_land_in_the_cache_not_the_sources(first_run):
    cache, result, beside_sources = first_run
    per_kernel = [line for line in result["log"] if line.startswith("compiled the ")]
    # float32: select and scores for the model's sketch layout (head dim 32: not the fused one),
    # place, attended-token mask, attention; bf16 adds its attention.
    assert len(per_kernel) == 6, result["log"]
    assert not [line for line in per_kernel if "fused layout" in line], "attach() compiled a layout it does not use"
    summaries = [line for line in result["log"] if re.match(r"compiled \d+ CPU kernels? in ", line)]
    assert len(summaries) == 2, result["log"]  # one per attach()
    assert summaries[0].startswith("compiled 5 CPU kernels in ") and "first run on this machine" in summaries[0]
    assert summaries[1].startswith("compiled 1 CPU kernel in "), "the bf16 model's other kernels were loaded already"
    target = cache / "numba" / f"kernels-{jit_cache.source_digest('kvdrive.kernels')}"
    assert Path(result["cache_path"]).parent == target and str(target) in summaries[0]
    assert numba_files(cache / "numba"), "no compiled kernel was written to the cache"
    assert numba_files(KERNELS_DIR) == beside_sources, "numba wrote beside the kernels' sources"


def test_a_later_process_loads_every_kernel_from_the_cache(first_run):
    cache, _, _ = first_run
    result = run_probe(WARM_PROBE, fresh_env(cache))
    assert result["compiled"] == [] and len(result["loaded"]) == 6, result
    assert result["summary"].startswith("loaded 6 CPU kernels from the cache in ")


def test_warm_up_again_in_a_process_has_nothing_to_do():
    warm_up(indexes=())  # loaded (or compiled) here, if no earlier test of this process did
    report = warm_up(indexes=())
    assert report.compiled == report.loaded == () and report.summary == "the CPU kernels were already loaded in this process"


def test_warm_up_compiles_the_low_rank_kernels_of_the_layouts_it_is_given():
    """The fused layout's low-rank kernels never hold the other layouts' passes: a caller that
    names its layouts compiles only their kind; one that does not gets both kinds."""
    def lowrank(layouts):
        return [c.name for c in _cases((torch.float32,), ("lowrank",), layouts) if c.name.startswith("lowrank")]

    fused, other = SketchLayout(27, 1, 12), SketchLayout(54, 2, 24)
    assert lowrank([fused]) == ["lowrank_select (fused layout)", "lowrank_scores (fused layout)"]
    assert lowrank([other]) == ["lowrank_select (other layouts)", "lowrank_scores (other layouts)"]
    assert lowrank(None) == lowrank([fused, other]) == lowrank([fused]) + lowrank([other])


def test_warm_up_refuses_a_dtype_the_kernels_do_not_read():
    with pytest.raises(ValueError, match="not torch.float64: cast the model"):
        warm_up(dtypes=(torch.float64,))


def test_the_compiled_kernels_are_the_cpu_ones_only():
    assert compiles_on_cpu("cpu") and compiles_on_cpu("cpu", "cpu")
    assert not compiles_on_cpu("cpu", "reference") and not compiles_on_cpu("cpu", "triton")
    assert not compiles_on_cpu("cuda", "auto") and not compiles_on_cpu("meta", "cpu")
