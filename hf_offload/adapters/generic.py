"""Fallback for decoder-only transformers models without a registered adapter."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .base import UnsupportedModelError, decoder_stack, innermost


def _is_layer_list(module: object) -> bool:
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(isinstance(innermost(layer), GradientCheckpointingLayer) for layer in module)
    )


def find_decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """`get_decoder().layers` when it is a list of GradientCheckpointingLayer (this covers
    composite models, whose get_decoder() is the text model), else the single such list
    under a `language_model`, else the single such list anywhere in the model."""
    layers = getattr(decoder_stack(model), "layers", None)
    if _is_layer_list(layers):
        return list(layers)
    candidates = [(name, module) for name, module in model.named_modules() if _is_layer_list(module)]
    text = [(name, module) for name, module in candidates if "language_model" in name.split(".")]
    chosen = text if text else candidates
    if len(chosen) == 1:
        return list(chosen[0][1])
    found = ", ".join(name for name, _ in candidates) or "none"
    raise UnsupportedModelError(
        f"hf_offload cannot tell which modules are the decoder layers of {type(model).__name__} "
        f"(model_type={getattr(getattr(model, 'config', None), 'model_type', None)!r}; lists of "
        f"GradientCheckpointingLayer found: {found}). Register an adapter that returns them in forward "
        "order: hf_offload.register_adapter('<model_type>', lambda model: model.<path>.layers)"
    )
