"""On a CUDA device, with Liger Kernel's Triton kernels really running (every kernel Liger applies to
Llama: RMSNorm, SwiGLU, RoPE and the fused linear cross-entropy): parity with and without
offloading, and less peak memory with offloading than with Liger alone. Skipped without CUDA;
tests/test_liger.py checks on the CPU what can be checked there."""

from __future__ import annotations

import pytest
import torch
from conftest import cuda_peak_bytes
from liger_kernel.transformers import apply_liger_kernel_to_llama
from peft import LoraConfig, get_peft_model
from test_liger import transformers_restored
from transformers import LlamaConfig, LlamaForCausalLM

import hf_offload  # noqa: F401
from hf_offload.integrations.liger import fused_linear_cross_entropy_in_use
from hf_offload.tools.modes import set_checkpointing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def deterministic_and_restored(deterministic_cuda_kernels):
    # cuBLAS (used by Liger's fused cross-entropy for its matmuls) and attention reduce in a fixed
    # order. Liger's Triton kernels used here are deterministic by construction (RMSNorm's weight
    # gradient is summed from per-program partials, not atomics; RoPE, SwiGLU and cross-entropy
    # work row by row), and each parity test checks that two runs without offloading agree
    # before comparing with offloading.
    with transformers_restored():  # Liger replaces transformers' classes for the whole process
        yield


def llama(hidden, layers, intermediate, vocab, attention, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=32768,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=ids)
    assert output.logits is None, "Liger's fused linear cross-entropy did not compute the loss"
    output.loss.backward()
    return output.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(expected, actual, what):
    expected_loss, expected_grads = expected
    loss, grads = actual
    assert torch.equal(expected_loss, loss), f"losses differ {what}"
    assert expected_grads.keys() == grads.keys() and expected_grads
    differing = [name for name in expected_grads if not torch.equal(expected_grads[name], grads[name])]
    assert not differing, f"gradients differ {what}: {differing[:5]}"


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_parity_under_liger(checkpointing, tuning):
    # Eager attention, as in tests/test_gpu.py: the fused attention kernels' backward need not be
    # deterministic. Both models are built before Liger is applied to either: applying it to one
    # instance also swaps transformers' RMSNorm and MLP classes for models built later.
    plain, offloaded = (llama(256, 4, 1024, 1000, "eager") for _ in range(2))
    for model in (plain, offloaded):
        apply_liger_kernel_to_llama(model=model)  # every kernel, loss through FLCE
    offloaded.enable_activation_offloading(min_offload_bytes=0)
    if checkpointing:
        set_checkpointing(plain, True)
        set_checkpointing(offloaded, True)
    if tuning == "lora":
        config = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
        torch.manual_seed(3)
        plain = get_peft_model(plain, config)
        torch.manual_seed(3)
        offloaded = get_peft_model(offloaded, config)
    assert fused_linear_cross_entropy_in_use(plain) and fused_linear_cross_entropy_in_use(offloaded)

    generator = torch.Generator().manual_seed(0)
    for index in range(3):
        ids = torch.randint(1000, (2, 512), generator=generator).cuda()
        expected = step(plain, ids)
        assert_same(expected, step(plain, ids), f"between two runs without offloading at step {index}")
        assert_same(expected, step(offloaded, ids), f"with offloading at step {index}")
    stats = offloaded.activation_offloading_stats()
    assert stats.mode == "cuda"
    assert stats.offloaded_tensors > 0 and stats.layers_offloaded == 3  # of 4: the last is kept


def peak_bytes(model, ids):
    return cuda_peak_bytes(step, model, ids)


def test_offloading_lowers_the_peak_under_checkpointing_and_liger():
    # bf16, full fine-tuning, batch 1: T = 32768 tokens, d = 256, L = 64 layers, vocab 32000.
    # With checkpointing, each layer keeps only its input, 2*d*T = 16 MiB: 64 * 16 = 1024 MiB.
    # Offloading moves all of them but the last layer's (kept), and in backward brings one back
    # ahead of need: (L - 2) * 16 MiB = 992 MiB less at the peak. The rest is the same in both
    # runs: weights (54M parameters, 108 MB) and their gradients (up to 108 MB), one layer
    # recomputed in backward (~7 KB per token saved inside a layer, ~220 MiB, plus as much in
    # gradients; sdpa keeps no T x T matrix) and Liger's loss head (its input gradient 2*d*T =
    # 16 MiB, the lm_head gradient 16 MB, 256-token chunks of bf16 logits, 16 MB). Predicted peak
    # about 1.6 GiB with checkpointing and Liger, about 0.7 GiB with offloading as well; the test
    # asks for at least half of the predicted 992 MiB.
    hidden, layers, tokens = 256, 64, 32768
    model = llama(hidden, layers, 512, 32000, "sdpa")
    apply_liger_kernel_to_llama(model=model)
    set_checkpointing(model, True)
    ids = torch.randint(32000, (1, tokens), generator=torch.Generator().manual_seed(0)).cuda()
    peak_bytes(model, ids)  # warm-up: allocator, Triton compilation
    liger_alone = peak_bytes(model, ids)
    model.enable_activation_offloading()
    peak_bytes(model, ids)
    offloaded = peak_bytes(model, ids)
    stats = model.activation_offloading_stats()
    assert stats.layers_offloaded == layers - 1 and stats.offloaded_bytes == (layers - 1) * 2 * hidden * tokens
    predicted = (layers - 2) * 2 * hidden * tokens
    assert liger_alone - offloaded > predicted / 2, (
        f"peak {offloaded / 2**20:.0f} MiB with offloading vs {liger_alone / 2**20:.0f} MiB with checkpointing and "
        f"Liger alone; predicted about {predicted / 2**20:.0f} MiB less"
    )
