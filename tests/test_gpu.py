"""On a CUDA device: parity with the real streams, less peak memory, no growth over many steps.
Skipped without CUDA; `python -m hf_offload.tools.benchmarks.gpu_check` runs them (and runs the parity
test again under PyTorch's CUDA stream sanitizer)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import cuda_peak_bytes
from transformers import LlamaConfig, LlamaForCausalLM

import hf_offload  # noqa: F401
from hf_offload.tools.modes import set_checkpointing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("deterministic_cuda_kernels"),
]


def llama(hidden=256, layers=4, vocab=1000, dtype=torch.float32, seed=0, attention="sdpa"):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=8192,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).to("cuda", dtype).train()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_parity_on_cuda(checkpointing):
    # Eager attention: the fused attention kernels' backward need not be deterministic, and then two
    # runs without offloading would already differ.
    plain = llama(attention="eager")
    offloaded = copy.deepcopy(plain)
    offloaded.enable_activation_offloading(min_offload_bytes=0)
    if checkpointing:
        set_checkpointing(plain, True)
        set_checkpointing(offloaded, True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(1000, (2, 512), generator=generator).cuda()
        expected_loss, expected = step(plain, ids)
        loss, actual = step(offloaded, ids)
        assert torch.equal(expected_loss, loss)
        for name in expected:
            assert torch.equal(expected[name], actual[name]), name
    stats = offloaded.activation_offloading_stats()
    assert stats.mode == "cuda" and stats.offloaded_tensors > 0


def peak_bytes(model, ids):
    return cuda_peak_bytes(step, model, ids)


def test_peak_memory_drops():
    ids = torch.randint(1000, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    # 16 layers: about 3.4 GiB of activations without offloading, against at most 3 layers' worth
    # (0.6 GiB) resident with it (hf-offload estimate), beside 0.5 GiB of weights and as much of
    # gradients; a ratio near 0.4, not a close call.
    model = llama(hidden=1024, layers=16, dtype=torch.bfloat16)
    peak_bytes(model, ids)  # warm-up: allocator and kernels
    plain = peak_bytes(model, ids)
    model.enable_activation_offloading()
    peak_bytes(model, ids)
    offloaded = peak_bytes(model, ids)
    assert offloaded < 0.6 * plain, f"peak {offloaded / 2**20:.0f} MiB vs {plain / 2**20:.0f} MiB without offloading"


def test_no_memory_growth_over_50_steps():
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    model = llama(hidden=512, layers=6, dtype=torch.bfloat16)
    model.enable_activation_offloading()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1000, (1, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    device_after, rss_after, pool_after = [], [], []
    for _ in range(50):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        device_after.append(torch.cuda.memory_allocated())
        rss_after.append(process.memory_info().rss)
        pool_after.append(model.activation_offloading_stats().pool_bytes)
    assert len(set(device_after[5:])) == 1, "device memory after a step changed"
    assert len(set(pool_after[2:])) == 1, "the pinned pool grew after the first steps"
    assert max(rss_after[10:]) - min(rss_after[10:]) < 64 * 2**20, "host memory grew by more than 64 MiB"
    assert model.activation_offloading_stats().host_bytes_held == 0
