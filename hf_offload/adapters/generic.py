"""Fallback for decoder-only transformers models without a registered adapter."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..integrations.upstream import resolve
from .base import UnsupportedModelError, decoder_stack, innermost

# What configs call their number of decoder layers (most map the others onto num_hidden_layers).
_LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _is_layer_list(module: object) -> bool:
    checkpointing_layer = resolve("transformers.checkpointing_layer")
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(isinstance(innermost(layer), checkpointing_layer) for layer in module)
    )


def _configured_layer_count(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    try:
        text_config = config.get_text_config()
    except (AttributeError, ValueError):  # not a transformers config, or one with several text configs
        text_config = config
    for name in _LAYER_COUNT_NAMES:
        count = getattr(text_config, name, None)
        if isinstance(count, int) and count > 0:
            return count
    return None


def _is_plain_stack(module: object, count: int | None) -> bool:
    return (
        isinstance(module, nn.ModuleList)
        and count is not None
        and len(module) == count
        and len({type(innermost(layer)) for layer in module}) == 1
    )


def find_decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """`get_decoder().layers` when it is a list of GradientCheckpointingLayer (this covers
    composite models, whose get_decoder() is the text model), else the single such list
    under a `language_model`, else the single such list anywhere in the model; failing all
    of those, the single list of modules of one class as long as the configured layer count."""
    layers = getattr(decoder_stack(model), "layers", None)
    if _is_layer_list(layers):
        return list(layers)
    candidates = [(name, module) for name, module in model.named_modules() if _is_layer_list(module)]
    text = [(name, module) for name, module in candidates if "language_model" in name.split(".")]
    chosen = text if text else candidates
    if len(chosen) == 1:
        return list(chosen[0][1])
    searched = f"lists of GradientCheckpointingLayer found: {_names(candidates)}"
    if not candidates:
        # transformers leaves some older decoders' layers plain modules (ctrl, openai-gpt, xlnet...): the
        # length and the single class tell their stack from the model's other lists.
        count = _configured_layer_count(model)
        stacks = [(name, module) for name, module in model.named_modules() if _is_plain_stack(module, count)]
        if len(stacks) == 1:
            return list(stacks[0][1])
        searched += f"; lists of {count} modules of one class (the configured layer count): {_names(stacks)}"
        candidates = stacks
    advice = (
        "Register an adapter that returns them in forward order: "
        "hf_offload.register_adapter('<model_type>', lambda model: model.<path>.layers)"
    )
    if len(candidates) > 1:
        advice += (
            "; where those are stacks of layers that run one after another, it may return them concatenated "
            "in forward order, e.g. "
            "hf_offload.register_adapter('<model_type>', lambda model: [*model.<a>.layers, *model.<b>.layers])"
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    raise UnsupportedModelError(
        f"hf_offload cannot tell which modules are the decoder layers of {type(model).__name__} "
        f"(model_type={model_type!r}; {searched}). {advice}"
    )


def _names(found: list[tuple[str, nn.Module]]) -> str:
    return ", ".join(name for name, _ in found) or "none"
