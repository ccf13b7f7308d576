"""Liger Kernel together with activation offloading, on the CPU.

How Liger 0.8.5 patches the four families hf_offload supports, read from its monkey_patch.py:
- `apply_liger_kernel_to_<family>(model=m, ...)` binds its own functions on the instances:
  `m.forward` becomes its `lce_forward` (fused linear cross-entropy, FLCE), each RMSNorm's and each
  MLP's `forward` becomes LigerRMSNorm's / LigerSwiGLUMLP's (gemma: LigerGEGLUMLP's). It also
  replaces, for the rest of the process, `apply_rotary_pos_emb`, the RMSNorm class and the MLP
  class in transformers' modeling module. Without `model=` it patches only those module
  globals and `<Family>ForCausalLM.forward` on the class. It never touches a decoder layer's own
  `forward`, which is where hf_offload's wrapper sits.
- `TrainingArguments(use_liger_kernel=True)`: `Trainer.train()` (not its constructor) unwraps a
  PEFT model and calls `_apply_liger_kernel_to_instance(model=base, **liger_kernel_config)`, the
  instance path above.

What the CPU can prove, and how:
- Structure, with every Liger patch on (RMSNorm, SwiGLU/GeGLU, RoPE, FLCE), in both orders, with
  PEFT LoRA added before, between or after, and through Trainer's own application: the decoder
  layers still run hf_offload's wrapper, Liger's patches are all in place, and disabling
  offloading leaves exactly what Liger alone leaves. With those patches the decoder layers call
  Triton kernels, which cannot run on a CPU, so no step runs in these tests.
- Training steps, with only Liger's FLCE patched (rope, rms_norm, swiglu/geglu off, so the decoder
  layers are plain torch): Liger's own patched forward runs, through `LigerForCausalLMLoss` down to
  `LigerFusedLinearCrossEntropyFunction.apply`, where the Triton autograd function is replaced
  by `ChunkedLinearCrossEntropy`, a pure-torch stand-in with the same signature and the same
  scheme (loss and gradients computed in forward, a few tokens at a time; backward only scales
  the saved gradients). Under the same patching, gradients with offloading equal those without,
  bit for bit, and the offloading statistics equal those of the same model without Liger.
  This proves that the two scopes compose (Liger's loss runs outside the decoder layers, where
  hf_offload never looks); it says nothing about Triton's numerics, which tests/test_gpu_liger.py
  checks on a GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from conftest import (
    VOCAB,
    RandomTokens,
    assert_bit_identical,
    batch,
    enable_sim,
    grads,
    quiet_training_args,
    tiny_model,
    train_step,
)
from liger_kernel.transformers import monkey_patch
from liger_kernel.transformers.geglu import LigerGEGLUMLP
from liger_kernel.transformers.rms_norm import LigerRMSNorm
from liger_kernel.transformers.rope import liger_rotary_pos_emb
from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.models.gemma import modeling_gemma
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

import hf_offload
from hf_offload import instance_forward
from hf_offload.adapters import BUILTIN_MODEL_TYPES, resolve_layers, unwrap_model
from hf_offload.api import LAYER_STATE_ATTR, MODEL_STATE_ATTR, _offloaded_forward
from hf_offload.integrations.liger import fused_linear_cross_entropy_in_use
from hf_offload.tools.modes import set_checkpointing

FAMILIES = ("llama", "qwen2", "mistral", "gemma")
MODELING = {"llama": modeling_llama, "qwen2": modeling_qwen2, "mistral": modeling_mistral, "gemma": modeling_gemma}
MLP_CLASS = {"llama": LigerSwiGLUMLP, "qwen2": LigerSwiGLUMLP, "mistral": LigerSwiGLUMLP, "gemma": LigerGEGLUMLP}

# Liger's own defaults for these families: every kernel on, the loss through FLCE.
FULL = {"fused_linear_cross_entropy": True}
# Only the loss head patched: the decoder layers stay plain torch and a step can run here.
FLCE_ONLY = {"rope": False, "rms_norm": False, "swiglu": False, "geglu": False, "fused_linear_cross_entropy": True}


def liger_options(family: str, options: dict) -> dict:
    """Keep the options the family's apply function takes (gemma has geglu, not swiglu), as
    Liger's own _apply_liger_kernel_to_instance does."""
    parameters = inspect.signature(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[family]).parameters
    return {key: value for key, value in options.items() if key in parameters}


def lce_forward_of(family: str):
    return getattr(monkey_patch, f"{family}_lce_forward")


@contextlib.contextmanager
def transformers_restored() -> Iterator[None]:
    """Liger patches transformers' modeling modules and classes for the whole process, even when
    given a model instance; put back everything it could have replaced, so that no other test
    builds a model with Triton-only modules."""
    saved_modules = {module: dict(vars(module)) for module in MODELING.values()}
    saved_forwards = {
        value: value.__dict__.get("forward")
        for module in MODELING.values()
        for value in vars(module).values()
        if isinstance(value, type) and value.__module__ == module.__name__
    }
    saved_cross_entropy = torch.nn.functional.cross_entropy
    try:
        yield
    finally:
        torch.nn.functional.cross_entropy = saved_cross_entropy
        for cls, forward in saved_forwards.items():
            if cls.__dict__.get("forward") is not forward:
                if forward is None:
                    delattr(cls, "forward")
                else:
                    cls.forward = forward
        for module, saved in saved_modules.items():
            for name in set(vars(module)) - set(saved):
                delattr(module, name)
            for name, value in saved.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)


@pytest.fixture(autouse=True)
def restore_transformers():
    with transformers_restored():
        yield


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Pure-torch stand-in for Liger's Triton `LigerFusedLinearCrossEntropyFunction`, called by
    Liger's code with the same arguments. Like Liger's, it computes the loss and both gradients
    in forward, CHUNK tokens at a time (the full logits never exist), saves only those gradients
    and scales them by the incoming gradient in backward. Options the tests never use raise."""

    CHUNK = 8
    calls = 0

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss=False,
        accum_dtype=None,
        use_token_scaling=False,
        return_token_accuracy=False,
        return_predicted_tokens=False,
    ):
        unused = {
            "bias": bias,
            "ce_weight": ce_weight,
            "lse_square_scale": lse_square_scale or None,
            "label_smoothing": label_smoothing or None,
            "softcap": softcap,
            "return_z_loss": return_z_loss or None,
            "accum_dtype": accum_dtype,
            "use_token_scaling": use_token_scaling or None,
            "return_token_accuracy": return_token_accuracy or None,
            "return_predicted_tokens": return_predicted_tokens or None,
        }
        unsupported = {name: value for name, value in unused.items() if value is not None}
        if unsupported or reduction not in ("mean", "sum"):
            raise NotImplementedError(f"the test's FLCE stand-in does not do {unsupported or reduction}")
        ChunkedLinearCrossEntropy.calls += 1
        valid = target != ignore_index
        scale = 1.0 / valid.sum().item() if reduction == "mean" else 1.0
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], ChunkedLinearCrossEntropy.CHUNK):
            rows = slice(start, start + ChunkedLinearCrossEntropy.CHUNK)
            chunk = hidden[rows]
            log_probs = (chunk @ weight.t()).float().log_softmax(-1)
            kept = valid[rows].nonzero().squeeze(1)
            picked = target[rows][kept]
            loss -= log_probs[kept, picked].sum()
            grad_logits = log_probs.exp()
            grad_logits[kept, picked] -= 1.0
            grad_logits[~valid[rows]] = 0.0
            grad_logits = (grad_logits * scale).to(hidden.dtype)
            grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ chunk
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss * scale, None, None, None

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grad_hidden, grad_weight = ctx.saved_tensors
        grads = (grad_hidden * grad_loss, None if grad_weight is None else grad_weight * grad_loss)
        return grads + (None,) * (len(ctx.needs_input_grad) - 2)


@pytest.fixture
def torch_flce(monkeypatch):
    """Liger's FLCE path with its Triton autograd function replaced (see the module docstring)."""
    import liger_kernel.transformers.functional as liger_functional

    monkeypatch.setattr(liger_functional, "LigerFusedLinearCrossEntropyFunction", ChunkedLinearCrossEntropy)
    monkeypatch.setattr(ChunkedLinearCrossEntropy, "calls", 0)
    return ChunkedLinearCrossEntropy


# ---------------------------------------------------------------------------------------------
# Building a model by a sequence of operations


def adapt(model: torch.nn.Module) -> PeftModel:
    torch.manual_seed(3)  # the same adapters in every model built from the same sequence
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def build(family: str, liger: dict | None, *orders: tuple[str, ...]) -> list[torch.nn.Module]:
    """One tiny model of `family` per order of operations: "liger_class" (Liger applied before
    the model is built: class-level patches), "liger" (applied to the instance, to the base
    model under a PEFT wrapper, as Trainer does), "offload", "peft". `liger=None` leaves out the
    Liger operations. Every model is built before any Liger patch that its order does not ask
    for: applying Liger to one instance also replaces transformers' RMSNorm and MLP classes for
    models built later."""
    apply = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[family]
    options = liger_options(family, liger or {})
    models = {i: tiny_model(family) for i, order in enumerate(orders) if liger is None or "liger_class" not in order}
    if len(models) < len(orders):
        apply(**options)
        models.update({i: tiny_model(family) for i in range(len(orders)) if i not in models})
    built = []
    for i, order in enumerate(orders):
        model = models[i]
        assert "liger_class" not in order[1:]
        for operation in order:
            if operation == "liger" and liger is not None:
                apply(model=unwrap_model(model), **options)
            elif operation == "offload":
                enable_sim(model)
            elif operation == "peft":
                model = adapt(model)
        built.append(model)
    return built


def without(operations: tuple[str, ...], *left_out: str) -> tuple[str, ...]:
    return tuple(operation for operation in operations if operation not in left_out)


ORDERS = [
    ("liger", "offload"),
    ("offload", "liger"),
    ("liger_class", "offload"),
    ("peft", "liger", "offload"),
    ("peft", "offload", "liger"),
    ("liger", "peft", "offload"),
    ("offload", "peft", "liger"),
    ("liger", "offload", "peft"),
    ("offload", "liger", "peft"),
    ("liger_class", "offload", "peft"),
    ("liger_class", "peft", "offload"),
]


def order_id(order: tuple[str, ...]) -> str:
    return "-".join(order)


# ---------------------------------------------------------------------------------------------
# What each side leaves on the model


def effective_forward(module: torch.nn.Module):
    """The function a call of `module` runs: its instance-level forward if it has one."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return type(module).forward
    if isinstance(forward, instance_forward.InstanceForward):
        return forward.wrapper
    return getattr(forward, "__func__", forward)


def assert_offloading_wrapped(model: torch.nn.Module) -> None:
    """Every decoder layer runs hf_offload's wrapper, tied to the model's offloading state.
    (is_activation_offloading alone reads the layer attribute, which outlives a forward
    replaced by somebody else; the wrapper itself is checked here.)"""
    base = unwrap_model(model)
    assert hf_offload.is_activation_offloading(model)
    controller = base.__dict__[MODEL_STATE_ATTR]
    _, layers = resolve_layers(base)
    assert len(layers) == base.config.num_hidden_layers
    for position, layer in enumerate(layers):
        assert effective_forward(layer) is _offloaded_forward, f"layer {position} does not run hf_offload's wrapper"
        slot = layer.__dict__[LAYER_STATE_ATTR]
        assert slot.controller is controller and slot.position == position


def assert_liger_patched(model: torch.nn.Module, family: str, full: bool) -> None:
    """Liger's loss forward on the model; with `full`, its RMSNorm, MLP and RoPE as well."""
    base = unwrap_model(model)
    assert effective_forward(base) is lce_forward_of(family)
    assert fused_linear_cross_entropy_in_use(model)
    modeling = MODELING[family]
    _, layers = resolve_layers(base)
    norms = [base.model.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if full:
        assert modeling.apply_rotary_pos_emb is liger_rotary_pos_emb
        assert all(effective_forward(norm) is LigerRMSNorm.forward for norm in norms)
        assert all(effective_forward(layer.mlp) is MLP_CLASS[family].forward for layer in layers)
    else:
        assert modeling.apply_rotary_pos_emb is not liger_rotary_pos_emb
        assert not any(isinstance(norm, LigerRMSNorm) or "forward" in norm.__dict__ for norm in norms)
        assert not any(isinstance(layer.mlp, MLP_CLASS[family]) or "forward" in layer.mlp.__dict__ for layer in layers)


def _describe(module: torch.nn.Module, value: object) -> object:
    func = getattr(value, "__func__", None)
    if func is not None:  # a bound method: which function, bound to this very module or not
        return ("method", func.__module__, func.__qualname__, value.__self__ is module)
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, dict):
        keys = tuple(value)
        return ("dict", keys if all(isinstance(key, str) for key in keys) else len(keys))
    if callable(value) and hasattr(value, "__qualname__"):
        return ("callable", getattr(value, "__module__", None), value.__qualname__)
    return type(value).__qualname__


def patch_state(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Every module's instance attributes, methods described by the function they run: what
    Liger and hf_offload add or replace."""
    return {
        name: {key: _describe(module, value) for key, value in sorted(module.__dict__.items())}
        for name, module in model.named_modules()
    }


def global_state(family: str) -> dict[str, int]:
    """The module globals and class forwards Liger may replace in transformers."""
    modeling = MODELING[family]
    state = {name: id(value) for name, value in vars(modeling).items()}
    for name, value in vars(modeling).items():
        if isinstance(value, type):
            state[f"{name}.forward"] = id(value.__dict__.get("forward"))
    return state


# ---------------------------------------------------------------------------------------------
# Structure, every Liger patch on


@pytest.mark.parametrize("order", ORDERS, ids=order_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_full_liger_and_offloading_keep_each_others_patches(family, order):
    model, liger_alone = build(family, FULL, order, without(order, "offload"))  # liger_alone: no offloading
    assert_offloading_wrapped(model)
    assert_liger_patched(model, family, full=True)
    assert_liger_patched(liger_alone, family, full=True)
    if "liger_class" in order:  # the classes themselves were replaced before the model was built
        _, layers = resolve_layers(unwrap_model(model))
        assert all(type(layer.mlp) is MLP_CLASS[family] for layer in layers)
        assert all(isinstance(layer.input_layernorm, LigerRMSNorm) for layer in layers)

    hf_offload.disable_activation_offloading(model)
    assert not hf_offload.is_activation_offloading(model)
    assert patch_state(model) == patch_state(liger_alone), "disabling did not leave exactly what Liger left"
    assert_liger_patched(model, family, full=True)
    hf_offload.enable_activation_offloading(model, simulate_on_cpu=True)  # and enabling again works
    assert_offloading_wrapped(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_offloading_leaves_transformers_globals_as_liger_left_them(family):
    first, second = build(family, None, (), ())
    before = global_state(family)
    enable_sim(first)  # offloading first
    assert global_state(family) == before
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[family](model=first, **liger_options(family, FULL))
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[family](model=second, **liger_options(family, FULL))
    patched = global_state(family)
    assert patched != before, "Liger replaced nothing in the modeling module"
    enable_sim(second)  # offloading after Liger
    hf_offload.disable_activation_offloading(first)
    hf_offload.disable_activation_offloading(second)
    assert global_state(family) == patched


def test_every_supported_family_has_a_liger_apply_function():
    assert set(BUILTIN_MODEL_TYPES) == set(FAMILIES), "a new built-in family: add it to this file"
    for family in FAMILIES:
        assert family in monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN
        assert "fused_linear_cross_entropy" in liger_options(family, FULL)


def test_the_structure_checks_catch_a_clobbered_patch():
    """Companion: the checks above fail when either side's patch is overwritten or left over."""
    first, second, third, liger_alone = build(
        "llama", FULL, ("liger", "offload"), ("offload", "liger"), ("liger", "offload"), ("liger",)
    )
    layer = first.model.layers[1]
    layer.forward = types.MethodType(type(layer).forward, layer)  # a patcher replacing our wrapper
    assert hf_offload.is_activation_offloading(first), "the attribute alone would not notice"
    with pytest.raises(AssertionError, match="layer 1 does not run"):
        assert_offloading_wrapped(first)

    del second.model.layers[0].mlp.forward  # Liger's MLP patch lost
    with pytest.raises(AssertionError):
        assert_liger_patched(second, "llama", full=True)

    hf_offload.disable_activation_offloading(third)
    assert patch_state(third) == patch_state(liger_alone)
    third.model.layers[2].__dict__["forward"] = types.MethodType(_offloaded_forward, third.model.layers[2])
    assert patch_state(third) != patch_state(liger_alone), "a wrapper left behind would go unnoticed"


# ---------------------------------------------------------------------------------------------
# Training steps under Liger's FLCE (Triton function replaced by the pure-torch stand-in)


def flce_train_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step as Liger runs it: FLCE computes the loss and no logits exist."""
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=ids)
    assert output.logits is None, "Liger's FLCE path did not run"
    output.loss.backward()
    return output.loss.detach(), grads(model)


def counted(stats: hf_offload.OffloadStats) -> dict[str, object]:
    """Every statistic but max_host_bytes, a limit derived from the host memory free when
    offloading was enabled."""
    return {name: value for name, value in stats.as_dict().items() if name != "max_host_bytes"}


STEP_ORDERS = [
    ("liger", "offload"),
    ("offload", "liger"),
    ("liger_class", "offload"),
    ("peft", "liger", "offload"),
    ("offload", "peft", "liger"),
    ("liger", "offload", "peft"),
]


@pytest.mark.parametrize("order", STEP_ORDERS, ids=order_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_flce_steps_bit_identical_and_statistics_unchanged(family, order, torch_flce):
    (without_liger,) = build(family, None, order)  # built before any class-level patch
    assert not fused_linear_cross_entropy_in_use(without_liger)
    model, liger_alone = build(family, FLCE_ONLY, order, without(order, "offload"))
    assert_offloading_wrapped(model)
    assert_liger_patched(model, family, full=False)
    assert_liger_patched(liger_alone, family, full=False)

    for step in range(2):
        ids = batch(seed=10 + step)
        calls = torch_flce.calls
        # Under the same Liger patching, with and without offloading: bit for bit.
        expected_loss, expected = flce_train_step(liger_alone, ids)
        loss, actual = flce_train_step(model, ids)
        assert torch_flce.calls == calls + 2
        assert torch.equal(expected_loss, loss), f"losses differ at step {step}"
        assert_bit_identical(expected, actual)
        # The same model without Liger, offloaded: the same statistics, field for field.
        plain_loss, _ = train_step(without_liger, ids)
        torch.testing.assert_close(loss, plain_loss)
        stats = counted(hf_offload.activation_offloading_stats(model))
        assert stats["offloaded_tensors"] > 0 and stats["layers_offloaded"] == 2  # the last layer is kept
        assert stats == counted(hf_offload.activation_offloading_stats(without_liger)), (
            "Liger changed what hf_offload offloads or keeps"
        )


def test_flce_with_checkpointing_offloads_only_the_layer_inputs(torch_flce):
    """Checkpointing + Liger's FLCE + offloading, the combination tests/test_gpu_liger.py measures:
    bit for bit as checkpointing + FLCE alone, and what is offloaded is one layer input per
    layer but the last, as without Liger (the GPU test's arithmetic rests on this)."""
    (without_liger,) = build("llama", None, ("offload",))
    model, liger_alone = build("llama", FLCE_ONLY, ("liger", "offload"), ("liger",))
    for each in (without_liger, model, liger_alone):
        set_checkpointing(each, True)
    ids = batch(seed=6)
    expected_loss, expected = flce_train_step(liger_alone, ids)
    loss, actual = flce_train_step(model, ids)
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected, actual)
    train_step(without_liger, ids)
    stats = hf_offload.activation_offloading_stats(model)
    assert counted(stats) == counted(hf_offload.activation_offloading_stats(without_liger))
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert stats.offloaded_tensors == layers - 1
    assert stats.offloaded_bytes == (layers - 1) * ids.numel() * hidden * 4  # float32 layer inputs


def test_flce_stand_in_matches_transformers_loss(torch_flce):
    """The stand-in is a correct cross-entropy: Liger's patched forward with it gives
    transformers' own loss and gradients (to rounding), so the steps above are real steps."""
    plain = tiny_model("llama")
    (liger,) = build("llama", FLCE_ONLY, ("liger",))
    ids = batch(seed=4)
    ids[0, :5] = -100  # ignored labels are handled as transformers does
    losses, gradients = [], []
    for model in (plain, liger):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids.clamp(min=0), labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    assert torch_flce.calls == 1
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for name, grad in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_flce_parity_check_catches_a_changed_gradient(torch_flce, monkeypatch):
    """Companion: the bit-for-bit comparison above fails on a one-ulp change in what the
    loss head hands back, made in the second model's step only."""
    model, liger_alone = build("llama", FLCE_ONLY, ("liger", "offload"), ("liger",))
    ids = batch(seed=5)
    expected_loss, expected = flce_train_step(liger_alone, ids)
    original = ChunkedLinearCrossEntropy.backward

    def nudged_backward(ctx, grad_loss, *rest):
        grads = original(ctx, grad_loss, *rest)
        return (torch.nextafter(grads[0], grads[0] + 1),) + grads[1:]

    monkeypatch.setattr(ChunkedLinearCrossEntropy, "backward", staticmethod(nudged_backward))
    loss, actual = flce_train_step(model, ids)
    assert torch.equal(expected_loss, loss)
    with pytest.raises(AssertionError, match="gradients differ"):
        assert_bit_identical(expected, actual)


# ---------------------------------------------------------------------------------------------
# TrainingArguments(use_liger_kernel=True): Trainer applies Liger in train()


class _Stop(Exception):
    pass


class StopAtTrainBegin(TrainerCallback):
    """Stops train() after Trainer applied Liger and prepared the model, before any step."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise _Stop


def trainer_for(model, output_dir, liger_config: dict | None, callbacks=(), **overrides) -> Trainer:
    args = TrainingArguments(
        **quiet_training_args(output_dir, use_liger_kernel=True, liger_kernel_config=liger_config, **overrides)
    )
    return Trainer(model=model, args=args, train_dataset=RandomTokens(6, 0), callbacks=list(callbacks))


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_applies_full_liger_to_an_offloaded_model(tmp_path, family, tuning):
    order = ("offload", "peft") if tuning == "lora" else ("offload",)
    model, liger_alone = build(family, None, order, without(order, "offload"))
    assert not fused_linear_cross_entropy_in_use(model)
    for candidate, where in ((model, "offloaded"), (liger_alone, "alone")):
        # liger_kernel_config=None: Liger's defaults, every kernel on.
        trainer = trainer_for(candidate, tmp_path / where, None, callbacks=[StopAtTrainBegin()])
        assert not fused_linear_cross_entropy_in_use(candidate), "Trainer applied Liger before train()"
        with pytest.raises(_Stop):
            trainer.train()
    assert_offloading_wrapped(model)
    assert_liger_patched(model, family, full=True)
    hf_offload.disable_activation_offloading(model)
    assert patch_state(model) == patch_state(liger_alone)


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_trainer_with_liger_flce_trains_identically_with_offloading(tmp_path, tuning, torch_flce):
    runs = {}
    for name in ("alone", "offloaded"):
        model = tiny_model("llama")
        if name == "offloaded":
            enable_sim(model)
        if tuning == "lora":
            model = adapt(model)
        trainer = trainer_for(model, tmp_path / name, FLCE_ONLY)
        calls = torch_flce.calls
        trainer.train()
        assert torch_flce.calls - calls == 3, "the Trainer's steps did not go through Liger's FLCE"
        assert fused_linear_cross_entropy_in_use(model)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs[name] = (model, losses)
    (alone, expected), (offloaded, losses) = runs["alone"], runs["offloaded"]
    assert len(losses) == 3 and losses == expected
    assert all(loss < 2 * torch.log(torch.tensor(float(VOCAB))) for loss in losses)
    for (name, p), (_, q) in zip(alone.named_parameters(), offloaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert_offloading_wrapped(offloaded)
    stats = hf_offload.activation_offloading_stats(offloaded)
    assert stats.offloaded_tensors > 0 and stats.layers_offloaded == 2  # of 3: the last is kept


# ---------------------------------------------------------------------------------------------
# fused_linear_cross_entropy_in_use


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_linear_cross_entropy_in_use(family):
    model = tiny_model(family)
    assert not fused_linear_cross_entropy_in_use(model)
    apply = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[family]
    # Layer kernels and Liger's plain cross-entropy: the logits are still materialised.
    apply(model=model, **liger_options(family, {"fused_linear_cross_entropy": False, "cross_entropy": True}))
    assert not fused_linear_cross_entropy_in_use(model)
    apply(model=model, **liger_options(family, FULL))
    assert fused_linear_cross_entropy_in_use(model)
    assert fused_linear_cross_entropy_in_use(adapt(model))


def test_fused_linear_cross_entropy_in_use_every_way_of_applying():
    other = tiny_model("qwen2")
    peft_first = adapt(tiny_model("llama"))
    assert not fused_linear_cross_entropy_in_use(peft_first)
    monkey_patch.apply_liger_kernel_to_llama(model=peft_first.get_base_model(), **liger_options("llama", FLCE_ONLY))
    assert fused_linear_cross_entropy_in_use(peft_first)

    # On the class, before the model is built; only that family's class.
    monkey_patch.apply_liger_kernel_to_llama(**liger_options("llama", FLCE_ONLY))
    assert fused_linear_cross_entropy_in_use(tiny_model("llama"))
    assert not fused_linear_cross_entropy_in_use(other)
    assert not fused_linear_cross_entropy_in_use(tiny_model("mistral"))


def test_fused_linear_cross_entropy_in_use_through_trainer(tmp_path):
    model = adapt(tiny_model("mistral"))
    trainer = trainer_for(model, tmp_path, None, callbacks=[StopAtTrainBegin()])
    assert not fused_linear_cross_entropy_in_use(trainer.model)
    with pytest.raises(_Stop):
        trainer.train()
    assert fused_linear_cross_entropy_in_use(trainer.model)
    assert fused_linear_cross_entropy_in_use(model)
    model = tiny_model("mistral")
    trainer = trainer_for(model, tmp_path / "no_flce", {"fused_linear_cross_entropy": False}, [StopAtTrainBegin()])
    with pytest.raises(_Stop):
        trainer.train()
    assert not fused_linear_cross_entropy_in_use(model)


def test_fused_linear_cross_entropy_in_use_rejects_a_non_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fused_linear_cross_entropy_in_use("llama")


# ---------------------------------------------------------------------------------------------
# liger-kernel is optional


def test_hf_offload_imports_and_works_without_liger_kernel():
    script = """
import sys

class NoLiger:
    def find_spec(self, name, path=None, target=None):
        if name == "liger_kernel" or name.startswith("liger_kernel."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoLiger())
try:
    import liger_kernel  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the block did not work")
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import hf_offload
from hf_offload.integrations.liger import fused_linear_cross_entropy_in_use

config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
model = AutoModelForCausalLM.from_config(config)
model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
ids = torch.randint(50, (1, 8))
model(input_ids=ids, labels=ids).loss.backward()
assert model.activation_offloading_stats().offloaded_tensors > 0
assert not fused_linear_cross_entropy_in_use(model)
assert not any(name.startswith("liger_kernel") for name in sys.modules)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
