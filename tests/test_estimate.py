"""The estimator's predicted activation bytes against what the engine measures."""

from __future__ import annotations

import pytest
import torch
from conftest import BATCH, SEQ, batch, enable_sim, tiny_model, train_step
from peft import LoraConfig, get_peft_model

import hf_offload
from hf_offload.estimate import PRESETS, Shape, estimate, saved_bytes_per_token


def measured_bytes(model_type, tuning, checkpointing, dtype):
    model = tiny_model(model_type).to(dtype)
    if tuning != "full":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        if tuning == "lora_fp32":
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
    enable_sim(model, keep_last_layers=0)
    if checkpointing:
        model.activation_checkpointing_enable()
    train_step(model, batch())
    return hf_offload.activation_offloading_stats(model).offloaded_bytes, model


CASES = [
    ("full", False, torch.float32),
    ("full", True, torch.float32),
    ("full", False, torch.bfloat16),
    ("lora", False, torch.float32),
    ("lora", True, torch.float32),
    ("lora_fp32", False, torch.bfloat16),
]


@pytest.mark.parametrize("tuning,checkpointing,dtype", CASES)
def test_predicted_bytes_within_ten_percent_of_measured(model_type, tuning, checkpointing, dtype):
    measured, model = measured_bytes(model_type, tuning, checkpointing, dtype)
    shape = Shape.from_config(model.config)
    per_token = saved_bytes_per_token(
        shape,
        dtype_bytes=2 if dtype == torch.bfloat16 else 4,
        checkpointing=checkpointing,
        lora_rank=None if tuning == "full" else 4,
        lora_dtype_bytes=4 if tuning == "lora_fp32" else None,
    )
    predicted = per_token * BATCH * SEQ * shape.layers
    assert abs(predicted - measured) <= 0.10 * measured, f"predicted {predicted}, measured {measured}"


def test_presets_and_the_known_figure_for_llama_3_8b():
    shape = PRESETS["llama-3-8b"]
    # About 49 x hidden bytes per token per layer in bf16 (full), 2 x hidden with checkpointing.
    assert saved_bytes_per_token(shape, dtype_bytes=2) == pytest.approx(49 * shape.hidden, rel=0.02)
    assert saved_bytes_per_token(shape, dtype_bytes=2, checkpointing=True) == 2 * shape.hidden
    result = estimate(shape, seq_len=8192, dtype_bytes=2)
    assert result.total_bytes == result.layer_bytes * 32
    assert result.offloaded_bytes == result.layer_bytes * 31
    assert result.saved_bytes == result.layer_bytes * 29
    assert set(PRESETS) >= {"llama-3-8b", "qwen2-7b", "mistral-7b", "gemma-7b"}


def test_copies_hide_only_when_the_link_is_fast_enough():
    shape = PRESETS["llama-3-8b"]
    assert estimate(shape, seq_len=4096, checkpointing=True, link_gbps=25, tflops=400).hides_behind_compute
    assert not estimate(shape, seq_len=4096, link_gbps=1, tflops=400).hides_behind_compute
