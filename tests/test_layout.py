"""The product never loads the tools: a training step with offloading and tiling imports nothing
under `hf_offload.tools` (the command, the benchmarks, the simulator), nor Liger or TRL."""

from __future__ import annotations

import subprocess
import sys

TRAIN_AND_LIST_MODULES = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_offload

model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
model.enable_sequence_tiling(tile_tokens=8)
ids = torch.randint(128, (1, 16))
model(input_ids=ids, labels=ids).loss.backward()
assert model.activation_offloading_stats().offloaded_tensors > 0
assert model.is_sequence_tiling
print("\\n".join(sorted(sys.modules)))
"""


def loaded_modules(code: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(result.stdout.split())


def test_training_with_offloading_loads_no_tool_and_no_other_library():
    modules = loaded_modules(TRAIN_AND_LIST_MODULES)
    assert "hf_offload.engine.offloader" in modules  # the step did run the engine
    assert "hf_offload.tiling.per_token" in modules
    assert not {name for name in modules if name.startswith("hf_offload.tools")}
    assert not {name for name in modules if name.split(".")[0] in ("liger_kernel", "trl")}


def test_the_check_sees_a_tool_when_one_is_loaded():
    """Companion: the same listing shows a tool module once something imports it."""
    modules = loaded_modules(TRAIN_AND_LIST_MODULES.replace("import hf_offload\n", "import hf_offload.tools.bench\n"))
    assert "hf_offload.tools.bench" in modules
