"""PEFT beyond plain LoRA (which tests/test_parity.py covers): DoRA, the
`prepare_model_for_kbit_training` path on a model that is not quantized (real 4-bit and 8-bit
bases: tests/test_qlora.py), `merge_and_unload()` after training, and `save_pretrained` output.
Each compares against the same run without offloading, bit for bit, and checks that no parameter
storage was ever copied to the host."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import BATCH, SEQ, assert_bit_identical, batch, enable_sim, tiny_model, train_step, twin
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from routing import assert_parity_and_routing

import hf_offload

CHECKPOINTING = {"none": None, "non_reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True}}


def adapt(model: torch.nn.Module, seed: int = 3, **lora_options) -> PeftModel:
    torch.manual_seed(seed)
    # init_lora_weights=False gives B a random start, so every adapter gradient is non-zero.
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, **lora_options)
    return get_peft_model(model, config)


def sgd_steps(model: torch.nn.Module, steps: int = 2, seed: int = 1) -> list[torch.Tensor]:
    """A few real updates (so LoRA's B is no longer its initial value)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(steps):
        loss, _ = train_step(model, batch(seed=seed + step))
        optimizer.step()
        losses.append(loss)
    model.zero_grad(set_to_none=True)
    return losses


def instance_state(model: torch.nn.Module) -> dict[str, tuple]:
    """What enabling could have touched: every module's instance attributes and hooks."""
    return {
        name: (
            sorted(module.__dict__),
            len(module._forward_hooks),
            len(module._forward_pre_hooks),
            len(module._backward_hooks),
        )
        for name, module in model.named_modules()
    }


def offload_leftovers(model: torch.nn.Module) -> list[str]:
    return [
        f"{name or '<root>'}.{attribute}"
        for name, module in model.named_modules()
        for attribute in module.__dict__
        if "hf_offload" in attribute or (attribute == "forward" and name)
    ]


# --- DoRA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
def test_dora_parity_and_routing(checkpointing, monkeypatch):
    """LoraConfig(use_dora=True) on all linear layers: identical loss and gradients (including
    the magnitude vectors), no parameter storage offloaded, the expected tensors offloaded."""
    base = tiny_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    plain, offloaded = adapt(plain, use_dora=True), adapt(offloaded, use_dora=True)
    for model in (plain, offloaded):
        if CHECKPOINTING[checkpointing] is not None:
            model.activation_checkpointing_enable(CHECKPOINTING[checkpointing])
    stats = assert_parity_and_routing(plain, offloaded, monkeypatch)
    magnitudes = [n for n, p in offloaded.named_parameters() if "lora_magnitude_vector" in n and p.grad is not None]
    assert magnitudes, "DoRA's magnitude vectors should be trained"
    if checkpointing == "none":
        assert stats.kept_tensors["parameter"] > 0  # weight.t() views, lora_A/B and magnitude
    else:
        # The checkpointed layers' inputs, layer 0's too: the frozen embeddings' output, made to
        # require grad by checkpointing (a leaf of the graph), is detoured so that it moves.
        hidden = offloaded.config.hidden_size
        assert (stats.offloaded_tensors, stats.offloaded_bytes) == (2, 2 * BATCH * SEQ * hidden * 4)
        assert stats.kept_tensors["leaf"] == 0


# --- prepare_model_for_kbit_training -----------------------------------------------------------


# prepare_model_for_kbit_training enables checkpointing without use_reentrant, which torch warns about.
@pytest.mark.filterwarnings("ignore:.*use_reentrant parameter should be passed explicitly:UserWarning")
@pytest.mark.parametrize("variant", ["bf16_upcast", "kbit_branch"])
def test_prepare_model_for_kbit_training_parity_and_routing(variant, monkeypatch):
    """peft.prepare_model_for_kbit_training on a normal (not quantized) model, offloading enabled
    before it, then LoRA.

    bf16_upcast: a bf16 model; prepare freezes it and upcasts every parameter to fp32 with
    `param.data = ...`, which swaps the storage of parameters the engine has already seen.
    kbit_branch: the model claims `is_loaded_in_4bit` while prepare runs, so its k-bit branch runs
    for real: `enable_input_require_grads()` and gradient checkpointing with its default kwargs.
    (On real 4-bit and 8-bit models: tests/test_qlora.py.)
    """
    base = tiny_model()
    if variant == "bf16_upcast":
        base = base.to(torch.bfloat16)
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    for model in (plain, offloaded):
        if variant == "kbit_branch":
            model.is_loaded_in_4bit = True
        prepare_model_for_kbit_training(model)
        if variant == "kbit_branch":
            del model.is_loaded_in_4bit
        assert not any(p.requires_grad for p in model.parameters())
        assert all(p.dtype == torch.float32 for p in model.parameters())
    if variant == "kbit_branch":
        assert offloaded.is_activation_checkpointing
    plain, offloaded = adapt(plain), adapt(offloaded)
    assert offloaded.is_activation_offloading
    stats = assert_parity_and_routing(plain, offloaded, monkeypatch)
    if variant == "kbit_branch":  # the checkpointed layers' inputs, layer 0's (the embeddings' output) too
        hidden = offloaded.config.hidden_size
        assert (stats.offloaded_tensors, stats.offloaded_bytes) == (2, 2 * BATCH * SEQ * hidden * 4)
        assert stats.kept_tensors["leaf"] == 0 and stats.kept_tensors["parameter"] == 0
    else:
        assert stats.kept_tensors["parameter"] > 0


# --- merge_and_unload ---------------------------------------------------------------------------


@pytest.mark.parametrize("enable_before_peft", [True, False])
def test_merge_and_unload_after_training(enable_before_peft, monkeypatch):
    """merge_and_unload() returns the base model object, on which offloading was enabled (also
    when it was enabled through the PeftModel): it stays enabled, like gradient checkpointing
    would. What a user can rely on: the merged weights are those of the run without offloading,
    no PEFT module is left, the merged model trains bit-exactly with offloading (the merged
    weights are new parameters, and none is offloaded), and disable_activation_offloading()
    leaves it exactly like the merged model of the run that never had offloading."""
    base = tiny_model()
    plain, offloaded = base, twin(base)
    if enable_before_peft:
        enable_sim(offloaded)
    plain, offloaded = adapt(plain), adapt(offloaded)
    if not enable_before_peft:
        enable_sim(offloaded)
    base_model = offloaded.get_base_model()
    expected_losses, losses = sgd_steps(plain), sgd_steps(offloaded)
    assert all(torch.equal(a, b) for a, b in zip(expected_losses, losses, strict=True))

    plain_merged, merged = plain.merge_and_unload(), offloaded.merge_and_unload()
    assert merged is base_model
    assert not any("lora" in name for name in itertools.chain(dict(merged.named_modules()), merged.state_dict()))
    assert merged.is_activation_offloading
    for (name, p), (_, q) in zip(plain_merged.named_parameters(), merged.named_parameters(), strict=True):
        assert torch.equal(p, q), name

    for model in (plain_merged, merged):  # full fine-tuning of the merged model
        model.requires_grad_(True)
    assert_parity_and_routing(plain_merged, merged, monkeypatch, steps=1)

    merged.disable_activation_offloading()
    assert not merged.is_activation_offloading
    assert offload_leftovers(merged) == []
    assert instance_state(merged) == instance_state(plain_merged)
    for layer in merged.model.layers:
        assert layer.forward.__func__ is type(layer).forward
    expected_loss, expected_grads = train_step(plain_merged, batch(seed=7))
    loss, actual_grads = train_step(merged, batch(seed=7))
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected_grads, actual_grads)


# --- save_pretrained ------------------------------------------------------------------------------


def saved_files(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


@pytest.mark.parametrize("what", ["adapter", "merged", "full"])
def test_save_pretrained_is_identical_with_offloading(what, tmp_path):
    """Train the same model with and without offloading, save both: the same files, byte for byte
    (adapter: PeftModel.save_pretrained; merged: after merge_and_unload, offloading still enabled;
    full: a full fine-tune saved while offloading is enabled)."""
    base = tiny_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    if what in ("adapter", "merged"):
        plain, offloaded = adapt(plain), adapt(offloaded)
    sgd_steps(plain)
    sgd_steps(offloaded)
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors > 0
    if what == "merged":
        plain, offloaded = plain.merge_and_unload(), offloaded.merge_and_unload()
    assert offloaded.is_activation_offloading
    plain.save_pretrained(tmp_path / "plain")
    offloaded.save_pretrained(tmp_path / "offloaded")
    expected, actual = saved_files(tmp_path / "plain"), saved_files(tmp_path / "offloaded")
    weights = "adapter_model.safetensors" if what == "adapter" else "model.safetensors"
    assert weights in expected
    assert expected.keys() == actual.keys()
    differing = [name for name in expected if expected[name] != actual[name]]
    assert not differing, f"saved files differ: {differing}"
    assert b"hf_offload" not in b"".join(actual.values())


def test_saved_adapter_loads_onto_an_offloaded_model(tmp_path, monkeypatch):
    """PeftModel.from_pretrained(base with offloading enabled, adapter directory, is_trainable=True)
    continues training bit-exactly, like the same adapter loaded onto a plain base."""
    trained = adapt(tiny_model())
    sgd_steps(trained)
    trained.save_pretrained(tmp_path)
    plain_base, offloaded_base = tiny_model(), tiny_model()
    enable_sim(offloaded_base)
    plain = PeftModel.from_pretrained(plain_base, tmp_path, is_trainable=True)
    offloaded = PeftModel.from_pretrained(offloaded_base, tmp_path, is_trainable=True)
    assert offloaded.is_activation_offloading
    assert_parity_and_routing(plain, offloaded, monkeypatch)
