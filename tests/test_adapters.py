"""The adapter registry, the generic fallback and unsupported models."""

from __future__ import annotations

import pytest
import registry_models
import torch
from conftest import TINY_CONFIGS, assert_same_step, batch, enable_sim, tiny_model, train_step, twin
from transformers import AutoConfig, AutoModelForCausalLM

import hf_offload
from hf_offload.adapters import BUILTIN_MODEL_TYPES, UnsupportedModelError, resolve_layers


def test_every_builtin_adapter_has_a_tiny_config_test():
    assert set(BUILTIN_MODEL_TYPES) == {"llama", "qwen2", "mistral", "gemma"}
    assert set(BUILTIN_MODEL_TYPES) <= set(TINY_CONFIGS)


def test_builtin_adapters_find_the_decoder_layers_in_order(model_type):
    model = tiny_model(model_type)
    adapter, layers = resolve_layers(model)
    assert adapter == model_type
    assert layers == list(model.model.layers)


def test_generic_fallback_for_an_unregistered_decoder_only_model():
    plain = tiny_model("qwen3")
    assert "qwen3" not in hf_offload.registered_model_types()
    adapter, layers = resolve_layers(plain)
    assert adapter == "generic" and layers == list(plain.model.layers)
    model = twin(plain)
    enable_sim(model)
    assert_same_step(plain, model, batch())
    assert model.activation_offloading_stats().offloaded_tensors > 0


def tiny_gemma3(vision_layers: int) -> torch.nn.Module:
    """A tiny gemma3 vision-language model: a gemma text decoder beside a vision tower."""
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers, num_attention_heads=4, image_size=32,
        patch_size=8,
    )  # fmt: skip
    config = AutoConfig.for_model("gemma3", text_config=dict(TINY_CONFIGS["gemma"]), vision_config=vision)
    return AutoModelForCausalLM.from_config(config)


def test_composite_model_resolves_its_text_decoder():
    model = tiny_gemma3(vision_layers=2)
    adapter, layers = resolve_layers(model)
    assert adapter == "generic"
    assert layers == list(model.get_decoder().layers)
    assert len(layers) == 3  # the text layers, not the vision tower's two


def test_registered_text_config_type_is_used_for_composites():
    hf_offload.register_adapter("gemma3_text", lambda model: list(model.get_decoder().layers))
    try:
        adapter, _ = resolve_layers(tiny_gemma3(vision_layers=1))
        assert adapter == "gemma3_text"
    finally:
        hf_offload.unregister_adapter("gemma3_text")


class NoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


def test_unsupported_model_names_its_class_and_how_to_register():
    with pytest.raises(UnsupportedModelError) as raised:
        hf_offload.enable_activation_offloading(NoLayers())
    message = str(raised.value)
    assert "NoLayers" in message and "hf_offload.register_adapter(" in message


def test_family_adapter_rejects_unexpected_layer_classes():
    model = tiny_model("llama")
    model.config.model_type = "mistral"  # a llama model claiming to be mistral
    with pytest.raises(UnsupportedModelError, match="MistralDecoderLayer.*LlamaDecoderLayer"):
        resolve_layers(model)


def test_register_adapter_validates_and_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        hf_offload.register_adapter("llama", lambda model: [])
    with pytest.raises(ValueError, match="non-empty string"):
        hf_offload.register_adapter("", lambda model: [])
    with pytest.raises(TypeError, match="must be callable"):
        hf_offload.register_adapter("toy", "model.layers")
    with pytest.raises(ValueError, match="built-in"):
        hf_offload.unregister_adapter("llama")


def test_user_registered_adapter_is_used():
    seen = []

    def find_layers(model):
        seen.append(type(model).__name__)
        return list(model.model.layers)

    hf_offload.register_adapter("qwen3", find_layers)
    try:
        model = tiny_model("qwen3")
        enable_sim(model)
        assert seen == ["Qwen3ForCausalLM"]
        train_step(model, batch())
        assert model.activation_offloading_stats().layers_offloaded == 2
    finally:
        hf_offload.unregister_adapter("qwen3")


# Decoders whose layers transformers leaves plain modules, not GradientCheckpointingLayers: where
# the generic fallback finds them (the one list of one class, as long as the configured layer count).
PLAIN_STACKS = {
    "ctrl": "transformer.h",
    "openai-gpt": "transformer.h",
    "gpt_neox_japanese": "gpt_neox_japanese.layers",
    "cpmant": "cpmant.encoder.layers",
    "xlnet": "transformer.layer",
}


@pytest.mark.parametrize("model_type", sorted(PLAIN_STACKS))
def test_generic_fallback_finds_plain_decoder_stacks(model_type):
    model = registry_models.tiny_model(model_type)
    adapter, layers = resolve_layers(model)
    assert adapter == "generic"
    assert layers == list(model.get_submodule(PLAIN_STACKS[model_type]))
    assert len(layers) == model.config.num_hidden_layers == registry_models.LAYERS


def test_offloading_a_plain_decoder_stack_is_bit_identical():
    plain = registry_models.tiny_model("openai-gpt")
    model = twin(plain)
    enable_sim(model)
    assert_same_step(plain, model, batch())
    assert model.activation_offloading_stats().offloaded_tensors > 0


def test_several_decoder_stacks_are_named_with_how_to_concatenate_them():
    model = registry_models.tiny_model("hrm_text")  # a low- and a high-level stack, run in cycles
    with pytest.raises(UnsupportedModelError) as raised:
        hf_offload.enable_activation_offloading(model)
    message = str(raised.value)
    assert "HrmTextForCausalLM" in message and "model_type='hrm_text'" in message
    assert "model.L_module.layers, model.H_module.layers" in message
    assert "lambda model: model.<path>.layers" in message  # the advice for one stack stays
    assert "concatenated in forward order" in message
    assert "lambda model: [*model.<a>.layers, *model.<b>.layers]" in message


def test_several_plain_lists_of_the_layer_count_are_refused_by_name():
    model = registry_models.tiny_model("xlm")  # per-layer parts in parallel lists, no module per layer
    with pytest.raises(UnsupportedModelError) as raised:
        resolve_layers(model)
    message = str(raised.value)
    assert "lists of GradientCheckpointingLayer found: none" in message
    assert "lists of 2 modules of one class (the configured layer count): transformer.attentions" in message
