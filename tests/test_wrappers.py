"""Decoder layers inside torch.distributed's checkpoint_wrapper (what FSDP's and accelerate's
`activation_checkpointing` apply): hf_offload wraps the wrapper, so that it stays outside the
checkpoint and offloads only the checkpoint's inputs, whether the wrapper was applied before
offloading was enabled or after it."""

from __future__ import annotations

import functools
import logging
import types

import pytest
import torch
from conftest import BATCH, SEQ, assert_same_step, batch, enable_sim, tiny_model, train_step
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from hf_offload import api
from hf_offload.adapters import resolve_layers

STEPS = 3


def wrap_in_checkpoints(model: torch.nn.Module, impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT) -> None:
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )


def offloaded_per_step(model, reference) -> list[int]:
    """Trains both for STEPS steps, asserting bit-identical losses and gradients at each;
    returns how many tensors hf_offload offloaded at each step."""
    counts = []
    for step in range(STEPS):
        ids = batch(seed=step)
        assert_same_step(reference, model, ids, f"step {step}")
        counts.append(model.activation_offloading_stats().offloaded_tensors)
    return counts


@pytest.fixture
def reference():
    model = tiny_model("llama", seed=0)
    wrap_in_checkpoints(model)
    return model


def only_checkpoint_inputs(model) -> int:
    """What offloaded checkpointing moves per step: each checkpointed layer's input hidden states,
    for every layer but the kept last one."""
    stats = model.activation_offloading_stats()
    hidden = model.config.hidden_size
    layers = model.config.num_hidden_layers - 1
    assert stats.offloaded_bytes == layers * BATCH * SEQ * hidden * 4
    return layers


def test_enabled_after_checkpoint_wrapper(reference):
    model = tiny_model("llama", seed=0)
    wrap_in_checkpoints(model)
    enable_sim(model)
    _, layers = resolve_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["CheckpointWrapper"] * model.config.num_hidden_layers
    counts = offloaded_per_step(model, reference)
    assert counts == [only_checkpoint_inputs(model)] * STEPS


@pytest.mark.parametrize(
    "impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT], ids=["non_reentrant", "reentrant"]
)
def test_checkpoint_wrapper_applied_after_enabling(impl, caplog):
    """Trainer and accelerate apply FSDP's activation checkpointing in prepare(), after the user
    enabled offloading: the first step runs as checkpointing alone, then hf_offload wraps the
    wrappers and offloads the checkpoint inputs (not everything the layers save). A reentrant
    wrapper runs the layer under no_grad and is noticed when backward recomputes the layer."""
    reference = tiny_model("llama", seed=0)
    wrap_in_checkpoints(reference, impl)
    model = tiny_model("llama", seed=0)
    enable_sim(model)
    wrap_in_checkpoints(model, impl)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        counts = offloaded_per_step(model, reference)
    assert counts[0] == 0 and counts[1] > 0 and counts[1:] == [counts[1]] * (STEPS - 1)
    layers = model.config.num_hidden_layers - 1
    # The checkpoints' inputs only: a few tensors per offloaded layer, not the dozens a layer saves.
    assert counts[1] <= 2 * layers
    if impl == CheckpointImpl.NO_REENTRANT:
        assert counts[1] == only_checkpoint_inputs(model)
    moved = [r for r in caplog.records if "hf_offload now wraps the wrappers" in r.getMessage()]
    assert len(moved) == 1
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in getattr(model, api.MODEL_STATE_ATTR).layers)


def test_checkpoint_wrapper_around_compiled_layer_is_wrapped_itself():
    """CheckpointWrapper forwards unknown attribute lookups to the module inside it: the adapters
    must not mistake the compiled (or FSDP1) module inside it for its own wrapped module, or they
    would wrap inside the checkpoint."""
    model = tiny_model("llama", seed=0)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = CheckpointWrapper(torch.compile(layer))
    _, layers = resolve_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["CheckpointWrapper"] * model.config.num_hidden_layers


def test_two_threads_moving_at_once_never_stack_wrappers(caplog):
    """nn.DataParallel replicas reach the first layer together, each through the wrapper of the
    same installation: the first re-wraps, the second finds it done (no second re-wrap, no
    contradicting warning), and installing again never puts ours around ours (which recursed
    without end)."""
    model = tiny_model("llama", seed=0)
    enable_sim(model)
    wrap_in_checkpoints(model)
    controller = getattr(model, api.MODEL_STATE_ATTR)
    old_slot = controller.layers[0]._hf_offload_layer
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        controller.move_outside_checkpoint(old_slot, "0")
        moved = list(controller.layers)
        controller.move_outside_checkpoint(old_slot, "0")  # the second replica's thread
    assert controller.layers == moved and controller.unmovable is None
    assert [r.getMessage() for r in caplog.records if "cannot wrap" in r.getMessage()] == []
    api._install(controller, controller.layers)
    for layer in model.model.layers:
        previous = layer._hf_offload_layer.previous_forward
        assert not (isinstance(previous, types.MethodType) and previous.__func__ is api._offloaded_forward)
    train_step(model, batch())


class HandRolledCheckpoint(torch.nn.Module):
    """A checkpoint around a layer that no adapter can see through."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.inner = layer

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def hand_rolled(model: torch.nn.Module) -> None:
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = HandRolledCheckpoint(layer)


def composable(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        composable_checkpoint(layer)


@pytest.mark.parametrize("apply", [hand_rolled, composable], ids=["hand_rolled", "composable"])
def test_checkpoint_that_cannot_be_wrapped_runs_plain_and_says_so(apply, caplog, monkeypatch):
    """torch.distributed's composable checkpoint(layer) enters its checkpoint in a forward
    pre-hook, so any wrapper of the layer's forward runs inside it; a hand-rolled module calling
    torch.utils.checkpoint is opaque to the adapters. Both train exactly as checkpointing alone,
    with one warning, and the layers are looked for once, not at every layer call."""
    resolved = []
    monkeypatch.setattr(api, "resolve_layers", lambda model: resolved.append(1) or resolve_layers(model))
    reference = tiny_model("llama", seed=0)
    model = tiny_model("llama", seed=0)
    enable_sim(model)
    apply(reference)
    apply(model)
    resolved.clear()
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        counts = offloaded_per_step(model, reference)
    assert counts == [0] * STEPS
    assert len(resolved) == 1
    warnings = [r.getMessage() for r in caplog.records if "cannot wrap from outside" in r.getMessage()]
    assert len(warnings) == 1 and "offloads nothing from layers run inside a checkpoint" in warnings[0]
