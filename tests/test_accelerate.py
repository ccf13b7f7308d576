"""A custom accelerate loop: `Accelerator(cpu=True)`, `prepare(model, optimizer, dataloader)`,
`accelerator.backward`, gradient accumulation through `accelerator.accumulate`. Offloaded runs
are bit-identical to the same loop without offloading, and the engine really engaged.

Two processes (prepare wrapping the model in DDP) are tested in tests/test_distributed.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from conftest import SEQ, VOCAB, enable_sim, run_example, tiny_model

import hf_offload
from hf_offload import instance_forward

GRAD_ACCUM = 2
OPTIMIZER_STEPS = 2
LAYERS = 3  # tiny_model's num_hidden_layers


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def dataset(micro_batches: int, batch_size: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (micro_batches * batch_size, SEQ), generator=generator)


def run_loop(model, *, enable=None, enable_after_prepare=False, mixed_precision="no", grad_accum=GRAD_ACCUM):
    """The loop a user writes. Returns what it observed; `enable(model)` turns offloading on,
    before prepare or, with enable_after_prepare, on accelerator.unwrap_model(prepared)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum, mixed_precision=mixed_precision)
    if enable is not None and not enable_after_prepare:
        enable(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(dataset(OPTIMIZER_STEPS * grad_accum), batch_size=2)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    unwrapped = accelerator.unwrap_model(prepared)
    if enable is not None and enable_after_prepare:
        enable(unwrapped)

    losses, offloaded, synced, weight_changed = [], [], [], []
    probe = unwrapped.model.layers[0].mlp.down_proj.weight
    for ids in loader:
        before = probe.detach().clone()
        with accelerator.accumulate(prepared):
            loss = prepared(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach().clone())
        synced.append(accelerator.sync_gradients)
        weight_changed.append(not torch.equal(before, probe.detach()))
        if enable is not None:
            offloaded.append(hf_offload.activation_offloading_stats(unwrapped).offloaded_tensors)
    weights = {name: p.detach().clone() for name, p in unwrapped.named_parameters()}
    return {
        "losses": losses,
        "weights": weights,
        "offloaded": offloaded,
        "synced": synced,
        "weight_changed": weight_changed,
        "prepared": prepared,
        "unwrapped": unwrapped,
    }


def assert_same(expected: dict, actual: dict) -> None:
    assert len(expected["losses"]) == len(actual["losses"]) == OPTIMIZER_STEPS * GRAD_ACCUM
    for step, (a, b) in enumerate(zip(expected["losses"], actual["losses"], strict=True)):
        assert torch.equal(a, b), f"micro-batch {step}: loss {a} != {b}"
    assert expected["weights"].keys() == actual["weights"].keys()
    differing = [k for k in expected["weights"] if not torch.equal(expected["weights"][k], actual["weights"][k])]
    assert not differing, f"final weights differ for {differing[:5]}"


def assert_accumulated(run: dict) -> None:
    """The optimizer stepped once per GRAD_ACCUM micro-batches, and only then."""
    expected = [(i + 1) % GRAD_ACCUM == 0 for i in range(OPTIMIZER_STEPS * GRAD_ACCUM)]
    assert run["synced"] == expected
    assert run["weight_changed"] == expected


def test_gradient_accumulation_loop_is_bit_identical():
    """Accelerator(cpu=True, gradient_accumulation_steps=2), offloading enabled before prepare:
    every micro-batch loss and the final weights after 2 AdamW steps equal the plain loop's."""
    base = tiny_model("llama")
    plain = run_loop(copy.deepcopy(base))
    offloaded = run_loop(base, enable=enable_sim)
    assert_same(plain, offloaded)
    assert_accumulated(plain)
    assert_accumulated(offloaded)
    # On one CPU process prepare hands back the model itself: the layer wrappers are untouched.
    assert offloaded["prepared"] is base
    assert all(count > 0 for count in offloaded["offloaded"]), offloaded["offloaded"]
    stats = hf_offload.activation_offloading_stats(base)
    assert stats.mode == "cpu-simulation"
    assert stats.kept_tensors["parameter"] > 0
    assert stats.total_layer_scopes == LAYERS * OPTIMIZER_STEPS * GRAD_ACCUM
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


def test_enable_after_prepare():
    """Enabling on accelerator.unwrap_model(prepared) after prepare works the same."""
    base = tiny_model("llama")
    plain = run_loop(copy.deepcopy(base))
    offloaded = run_loop(base, enable=enable_sim, enable_after_prepare=True)
    assert_same(plain, offloaded)
    assert all(count > 0 for count in offloaded["offloaded"])


def test_bf16_mixed_precision_wraps_forward_and_offloading_still_engages():
    """mixed_precision="bf16" makes prepare replace the model's forward with an autocast wrapper
    (an instance attribute on the root model); the decoder layers' wrappers are untouched,
    offloading engages on every micro-batch and the run stays bit-identical."""
    base = tiny_model("llama")
    plain = run_loop(copy.deepcopy(base), mixed_precision="bf16")
    offloaded = run_loop(base, enable=enable_sim, mixed_precision="bf16")
    assert_same(plain, offloaded)
    assert "forward" in base.__dict__, "accelerate no longer wraps forward for autocast; update this test"
    assert instance_forward.wraps(base.model.layers[0], hf_offload.api._offloaded_forward)
    assert all(count > 0 for count in offloaded["offloaded"])


def test_accelerate_example_runs_with_local_model(tmp_path):
    """examples/accelerate_loop.py with --model on a local directory (local_files_only=True)."""
    tiny_model("llama").save_pretrained(tmp_path)
    result = run_example(
        "accelerate_loop.py",
        "--model",
        str(tmp_path),
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--compare",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "processes: 1" in result.stdout and "step 1: loss" in result.stdout
    assert "offloaded: 0 tensors" not in result.stdout and "offloaded:" in result.stdout
    assert "bit-identical: losses yes, final weights yes" in result.stdout
