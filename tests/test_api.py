"""The public API: enable/disable round trips, PEFT, options, errors, no accelerator."""

from __future__ import annotations

import copy
import functools
import inspect
import types

import pytest
import torch
from conftest import assert_bit_identical, assert_same_step, batch, enable_sim, tiny_model, train_step, twin
from peft import LoraConfig, get_peft_model

import hf_offload
from hf_offload import instance_forward
from hf_offload.api import _offloaded_forward
from hf_offload.config import DEFAULT_MIN_OFFLOAD_BYTES


def module_state(model):
    """Everything enabling could have touched: every module's instance attributes and hooks."""
    state = {}
    for name, module in model.named_modules():
        state[name] = (
            sorted(module.__dict__),
            len(module._forward_hooks),
            len(module._forward_pre_hooks),
            len(module._backward_hooks),
        )
    return state


def test_disable_restores_the_model_exactly():
    model = tiny_model()
    before = module_state(model)
    forward_signature = inspect.signature(model.model.layers[0].forward)
    model.enable_activation_offloading(simulate_on_cpu=True)
    assert model.is_activation_offloading
    assert module_state(model) != before
    assert all(instance_forward.wraps(layer, _offloaded_forward) for layer in model.model.layers)
    model.disable_activation_offloading()
    assert not model.is_activation_offloading
    assert module_state(model) == before
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__
        assert layer.forward.__func__ is type(layer).forward
        assert layer.forward.__name__ == "forward"
        assert inspect.signature(layer.forward) == forward_signature
    model.disable_activation_offloading()  # a second disable is a no-op


def test_enable_twice_reconfigures_without_stacking():
    plain = tiny_model()
    model = twin(plain)
    enable_sim(model)
    enable_sim(model, keep_last_layers=2)
    for layer in model.model.layers:
        slot = layer.__dict__["_hf_offload_layer"]
        assert slot.previous_forward is None  # wraps the class forward, not our own wrapper
    assert_same_step(plain, model, batch())
    stats = model.activation_offloading_stats()
    assert stats.layers_offloaded == 1  # the new keep_last_layers=2 is in force
    assert stats.total_layer_scopes == 3  # one scope per layer call: nothing stacked


def wrap_layers_again(model):
    """An instance-level forward put over each layer's after offloading was enabled (a hook
    library, a profiler): it holds ours."""
    for layer in model.model.layers:
        inner = layer.forward
        layer.forward = functools.wraps(inner)(lambda *args, inner=inner, **kwargs: inner(*args, **kwargs))


def test_enabling_again_under_a_later_wrapper_reuses_our_pass_through(caplog):
    """Disabled under another wrapper, ours stays in its chain as a pass-through (said once per
    layer); enabling again makes that wrapper offload again, exactly, without stacking a second."""
    plain = tiny_model()
    model = twin(plain)
    enable_sim(model)
    wrap_layers_again(model)
    assert_same_step(plain, model, batch())
    hf_offload.disable_activation_offloading(model)
    assert "wrapped again after offloading was enabled" in caplog.text
    assert not model.is_activation_offloading
    assert_same_step(plain, model, batch(), "while disabled")
    enable_sim(model)
    assert_same_step(plain, model, batch(), "enabled again")
    stats = model.activation_offloading_stats()
    assert stats.offloaded_tensors > 0
    assert stats.total_layer_scopes == len(model.model.layers)  # one scope per layer call: nothing stacked


def test_a_second_wrapper_under_the_later_one_would_recurse_without_end(monkeypatch):
    """Companion: enabling again by wrapping whatever forward the layer has now (the later
    wrapper, which calls ours, which would call it) never returns."""
    from hf_offload import instance_forward

    def stack(module, wrapper, state_attr, make_state):
        setattr(module, state_attr, make_state(module.__dict__.get("forward")))
        module.forward = types.MethodType(wrapper, module)

    model = tiny_model()
    enable_sim(model)
    wrap_layers_again(model)
    hf_offload.disable_activation_offloading(model)
    monkeypatch.setattr(instance_forward, "install", stack)
    enable_sim(model)
    with pytest.raises(RecursionError):
        train_step(model, batch())


def test_an_existing_instance_forward_is_wrapped_and_restored():
    plain = tiny_model()
    model = twin(plain)
    layer = model.model.layers[0]
    calls = []
    original = layer.forward

    @functools.wraps(original)
    def user_wrapper(*args, **kwargs):  # what accelerate's hooks look like
        calls.append(1)
        return original(*args, **kwargs)

    layer.forward = user_wrapper
    enable_sim(model)
    assert_same_step(plain, model, batch())
    assert calls == [1]
    model.disable_activation_offloading()
    assert layer.__dict__["forward"] is user_wrapper


def test_works_on_a_peft_model():
    base = tiny_model()
    plain = get_peft_model(twin(base), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    torch.manual_seed(3)
    peft_model = copy.deepcopy(plain)
    peft_model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
    assert peft_model.is_activation_offloading
    assert hf_offload.is_activation_offloading(peft_model)
    assert_same_step(plain, peft_model, batch())
    assert hf_offload.activation_offloading_stats(peft_model).offloaded_tensors > 0
    hf_offload.disable_activation_offloading(peft_model)
    assert not peft_model.is_activation_offloading


def test_function_and_method_forms_agree():
    model = tiny_model()
    hf_offload.enable_activation_offloading(model, simulate_on_cpu=True)
    train_step(model, batch())
    assert hf_offload.activation_offloading_stats(model) == model.activation_offloading_stats()
    hf_offload.disable_activation_offloading(model)
    assert not hf_offload.is_activation_offloading(model)


def test_options_are_keyword_only():
    model = tiny_model()
    with pytest.raises(TypeError):
        model.enable_activation_offloading(1)


@pytest.mark.parametrize(
    "options,error,fragment",
    [
        ({"keep_last": 1}, TypeError, "unknown activation offloading option(s) 'keep_last'; valid options are"),
        ({"keep_last_layers": -1}, ValueError, "keep_last_layers must be an int >= 0, got -1"),
        ({"keep_last_layers": 1.0}, TypeError, "keep_last_layers must be an int >= 0, got 1.0 (float)"),
        ({"keep_last_layers": True}, TypeError, "keep_last_layers must be an int >= 0, got True (bool)"),
        ({"min_offload_bytes": -5}, ValueError, "min_offload_bytes must be an int >= 0, got -5"),
        ({"min_offload_bytes": "1MB"}, TypeError, "min_offload_bytes must be an int >= 0, got '1MB' (str)"),
        ({"simulate_on_cpu": 1}, TypeError, "simulate_on_cpu must be True or False, got 1 (int)"),
        ({"prefetch_layers": -1}, ValueError, "prefetch_layers must be an int >= 0, got -1"),
        ({"prefetch_layers": None}, TypeError, "prefetch_layers must be an int >= 0, got None (NoneType)"),
        ({"max_host_bytes": "8GB"}, TypeError, "max_host_bytes must be an int >= 0 or None, got '8GB' (str)"),
        ({"max_host_bytes": -1}, ValueError, "max_host_bytes must be an int >= 0 or None, got -1"),
    ],
)
def test_bad_options_name_the_option_and_what_is_valid(options, error, fragment):
    model = tiny_model()
    with pytest.raises(error) as raised:
        model.enable_activation_offloading(**options)
    assert fragment in str(raised.value)
    assert not model.is_activation_offloading  # nothing half-installed


def test_defaults():
    options = hf_offload.OffloadOptions()
    assert options == hf_offload.OffloadOptions(
        keep_last_layers=1,
        min_offload_bytes=DEFAULT_MIN_OFFLOAD_BYTES,
        prefetch_layers=1,
        max_host_bytes=None,
        simulate_on_cpu=False,
    )
    assert DEFAULT_MIN_OFFLOAD_BYTES == 512 * 1024


def test_stats_before_enable_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not enabled on this LlamaForCausalLM"):
        tiny_model().activation_offloading_stats()


def test_not_a_module_is_a_clear_error():
    with pytest.raises(TypeError, match="expected a torch.nn.Module.*got str"):
        hf_offload.enable_activation_offloading("meta-llama/Llama-3-8B")


def test_a_step_with_grad_in_eval_mode_says_once_that_nothing_is_offloaded(caplog):
    """Offloading works in training mode only, as transformers' checkpointing: a step with grad in
    eval mode offloads nothing, and says so once (before, silently); an evaluation under no_grad
    says nothing."""
    model = tiny_model()
    enable_sim(model)
    model.eval()
    with caplog.at_level("WARNING", logger="hf_offload"):
        for _ in range(2):
            train_step(model, batch())
        with torch.no_grad():
            model(input_ids=batch())
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_offload"]
    assert len(messages) == 1 and "LlamaForCausalLM ran a forward with grad in eval mode" in messages[0]
    assert "model.train()" in messages[0]
    assert model.activation_offloading_stats().total_layer_scopes == 0


def test_cpu_model_without_simulation_logs_once_and_does_no_work(caplog):
    plain = tiny_model()
    model = twin(plain)
    with caplog.at_level("WARNING", logger="hf_offload"):
        model.enable_activation_offloading()
        for _ in range(3):
            loss, actual = train_step(model, batch())
    expected_loss, expected = train_step(plain, batch())
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected, actual)
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_offload"]
    assert len(messages) == 1 and "on the CPU" in messages[0]
    stats = model.activation_offloading_stats()
    assert stats.total_layer_scopes == 0 and stats.total_pack_calls == 0 and stats.mode == "idle"


def test_deepcopied_model_has_its_own_state():
    model = tiny_model()
    enable_sim(model)
    clone = copy.deepcopy(model)
    train_step(clone, batch())
    assert clone.activation_offloading_stats().total_layer_scopes == 3
    assert model.activation_offloading_stats().total_layer_scopes == 0
    # The clone's wrappers run the clone's layers, not the original's.
    assert clone.model.layers[0].forward.__self__ is clone.model.layers[0]
    loss_clone, _ = train_step(clone, batch())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loss_clone_again, _ = train_step(clone, batch())
    assert torch.equal(loss_clone, loss_clone_again)


def test_layer_0_takes_the_frozen_embeddings_output_detoured_and_a_users_inputs_embeds_as_given():
    """With LoRA and checkpointing, PEFT makes the embeddings' output require grad: a leaf the
    graph would hold, which layer 0 takes detoured so that offloading frees it (bit-identical).
    An inputs_embeds the user passes, requiring grad, is not detoured: its gradient is theirs."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    base.activation_checkpointing_enable()
    plain = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    offloaded = twin(plain)
    offloaded.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
    assert_same_step(plain, offloaded, batch())
    stats = offloaded.activation_offloading_stats()
    assert stats.kept_tensors["leaf"] == 0 and stats.offloaded_tensors == offloaded.config.num_hidden_layers - 1

    embeds = []
    for model in (plain, offloaded):
        inputs = model.get_input_embeddings()(batch()).detach().requires_grad_(True)
        model(inputs_embeds=inputs, labels=batch()).loss.backward()
        embeds.append(inputs.grad)
    assert embeds[1] is not None and torch.equal(embeds[0], embeds[1])
    assert offloaded.activation_offloading_stats().kept_tensors["leaf"] == 1
