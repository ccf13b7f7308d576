"""Offloading never changes a result: bit-identical loss and gradients, for every supported
family, full fine-tuning and LoRA, with and without gradient checkpointing; and the right
tensors go through the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import BATCH, SEQ, assert_bit_identical, batch, enable_sim, loss_of, tiny_model, train_step, twin
from peft import LoraConfig, get_peft_model
from routing import assert_parity_and_routing

import hf_offload

CHECKPOINTING = {
    "none": None,
    "non_reentrant": {"use_reentrant": False},
    "reentrant": {"use_reentrant": True},
}


def lora(model, seed=3):
    torch.manual_seed(seed)
    # init_lora_weights=False gives B a random start, so every LoRA gradient is non-zero.
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def build_pair(model_type, tuning, checkpointing, enable_before_peft=True):
    """The same model twice: one plain, one offloaded (enabled before or after get_peft_model)."""
    base = tiny_model(model_type)
    plain, offloaded = base, twin(base)
    if tuning == "lora" and enable_before_peft:
        enable_sim(offloaded)
    if tuning == "lora":
        plain, offloaded = lora(plain), lora(offloaded)
    if not (tuning == "lora" and enable_before_peft):
        enable_sim(offloaded)
    for model in (plain, offloaded):
        if CHECKPOINTING[checkpointing] is not None:
            model.activation_checkpointing_enable(CHECKPOINTING[checkpointing])
    return plain, offloaded


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_parity_and_routing(model_type, tuning, checkpointing, monkeypatch):
    plain, offloaded = build_pair(model_type, tuning, checkpointing)
    # Two steps: the second runs on reused handles, registries and pooled buffers.
    stats = assert_parity_and_routing(plain, offloaded, monkeypatch, steps=2)
    assert stats.restored_tensors >= stats.offloaded_tensors
    if checkpointing != "none":
        # Exactly the checkpointed layers' inputs (hidden states), for every layer but the kept last
        # one. With LoRA the embeddings are frozen, and checkpointing makes their output (layer 0's
        # input) require grad, a leaf of the graph: layer 0 takes it detoured, and it moves too.
        hidden = offloaded.config.hidden_size
        assert stats.offloaded_tensors == 2
        assert stats.offloaded_bytes == 2 * BATCH * SEQ * hidden * 4
        assert stats.kept_tensors["leaf"] == 0
        assert stats.kept_tensors["parameter"] == 0
    else:
        assert stats.kept_tensors["parameter"] > 0
        assert stats.kept_tensors["duplicate"] > 0  # rotary cos/sin, shared by every layer


@pytest.mark.parametrize("checkpointing", ["none", "reentrant"])
def test_lora_enabled_after_get_peft_model(checkpointing):
    plain, offloaded = build_pair("llama", "lora", checkpointing, enable_before_peft=False)
    assert offloaded.is_activation_offloading
    ids = batch()
    expected_loss, expected_grads = train_step(plain, ids)
    loss, actual_grads = train_step(offloaded, ids)
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected_grads, actual_grads)
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors > 0


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
def test_checkpointing_is_not_defeated(checkpointing):
    """The number of tensors saved in the step with checkpointing + offloading equals the
    number saved by checkpointing alone (our hooks only route the checkpoint's inputs)."""

    def saved_count(model, engine_packs):
        counted = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: counted.append(1) or t.detach(), lambda t: t):
            loss = loss_of(model, batch())
        loss.backward()  # outside the counting hooks: a reentrant recompute saves again in backward
        return len(counted) + engine_packs(model)

    plain, offloaded = build_pair("llama", "full", checkpointing)
    offloaded_before = hf_offload.activation_offloading_stats(offloaded).total_pack_calls
    alone = saved_count(plain, lambda m: 0)
    ours = saved_count(
        offloaded, lambda m: hf_offload.activation_offloading_stats(m).total_pack_calls - offloaded_before
    )
    assert ours == alone
    # And checkpointing really is on: far fewer tensors than without it.
    unchecked = tiny_model("llama")
    assert saved_count(unchecked, lambda m: 0) > 3 * alone


def test_transformers_offload_true_is_reported_and_stays_exact(caplog, monkeypatch):
    import transformers.modeling_utils

    # transformers' offload=True asks for pinned memory, which a CPU-only machine cannot give;
    # the same hooks without pinning shadow ours in exactly the same way.
    unpinned = lambda pin_memory, device_type: torch.autograd.graph.save_on_cpu(pin_memory=False)  # noqa: E731
    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", unpinned)
    plain, offloaded = build_pair("llama", "full", "none")
    plain.activation_checkpointing_enable(offload=True)
    offloaded.activation_checkpointing_enable(offload=True)
    ids = batch()
    with caplog.at_level("WARNING", logger="hf_offload"):
        expected_loss, expected_grads = train_step(plain, ids)
        loss, actual_grads = train_step(offloaded, ids)
        train_step(offloaded, ids)
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected_grads, actual_grads)
    warnings = [r for r in caplog.records if "offload=True" in r.getMessage()]
    assert len(warnings) == 1, "the shadowing warning is logged once"
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors == 0
