"""Adapter registry keyed by `config.model_type`, with a generic fallback."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from . import gemma, llama, mistral, qwen2
from .base import (
    Adapter,
    FindLayers,
    FindMLP,
    UnsupportedModelError,
    find_attention,
    find_final_norm,
    find_layer_stack,
    find_linear_attention,
    find_mlp,
    find_norms,
    hook_point,
    innermost,
    is_linear_like,
    unwrap_model,
)
from .generic import find_decoder_layers

_REGISTRY: dict[str, Adapter] = {}
BUILTIN_MODEL_TYPES: tuple[str, ...] = ()


def register_adapter(model_type: str, find_layers: FindLayers, find_mlp: FindMLP | None = None) -> None:
    """Teach hf_offload the decoder layers of `model_type` (a `config.model_type` value).

    `find_layers(model)` must return the decoder layers in forward order. `find_mlp(layer)`, for
    sequence tiling, returns a decoder layer's per-token MLP (or None); without it the generic
    finder looks for a child named mlp, feed_forward, block_sparse_moe, ffn, mlp_block or shared_mlp.
    Registering a key twice is an error.
    """
    if not isinstance(model_type, str) or not model_type.strip():
        raise ValueError(f"model_type must be a non-empty string such as 'llama', got {model_type!r}")
    if not callable(find_layers):
        raise TypeError(f"find_layers must be callable as find_layers(model) -> layers, got {find_layers!r}")
    if find_mlp is not None and not callable(find_mlp):
        raise TypeError(f"find_mlp must be callable as find_mlp(layer) -> module or None, got {find_mlp!r}")
    if model_type in _REGISTRY:
        raise ValueError(f"an adapter for model_type {model_type!r} is already registered")
    _REGISTRY[model_type] = Adapter(model_type, find_layers, find_mlp)


def unregister_adapter(model_type: str) -> None:
    if model_type in BUILTIN_MODEL_TYPES:
        raise ValueError(f"{model_type!r} is a built-in adapter and cannot be removed")
    if model_type not in _REGISTRY:
        raise KeyError(f"no adapter registered for model_type {model_type!r}")
    del _REGISTRY[model_type]


def registered_model_types() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _model_types(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    types = [getattr(config, "model_type", None)]
    # Composite models (vision-language and the like) name their text model in text_config.
    text_config = getattr(config, "text_config", None)
    types.append(getattr(text_config, "model_type", None))
    return [t for t in types if isinstance(t, str) and t]


def resolve_layers(model: nn.Module) -> tuple[str, Sequence[nn.Module]]:
    """(adapter name, the modules to wrap for the decoder layers, in forward order) for `model`.
    A layer inside FSDP1 or torch.compile is wrapped inside them (see `hook_point`)."""
    for model_type in _model_types(model):
        adapter = _REGISTRY.get(model_type)
        if adapter is not None:
            layers = list(adapter.find_layers(model))
            if not layers:
                raise UnsupportedModelError(f"adapter {model_type!r} found no decoder layers in {type(model).__name__}")
            return model_type, [hook_point(layer) for layer in layers]
    return "generic", [hook_point(layer) for layer in find_decoder_layers(model)]


def resolve_mlps(model: nn.Module) -> list[nn.Module | None]:
    """Each decoder layer's MLP for sequence tiling, in layer order (None where a layer has none
    that is per token)."""
    adapter_name, layers = resolve_layers(model)
    adapter = _REGISTRY.get(adapter_name)
    finder = adapter.find_mlp if adapter is not None and adapter.find_mlp is not None else find_mlp
    return [finder(innermost(layer)) for layer in layers]


for _module in (llama, qwen2, mistral, gemma):
    register_adapter(_module.ADAPTER.model_type, _module.ADAPTER.find_layers)
BUILTIN_MODEL_TYPES = registered_model_types()

__all__ = [
    "BUILTIN_MODEL_TYPES",
    "Adapter",
    "UnsupportedModelError",
    "register_adapter",
    "registered_model_types",
    "resolve_layers",
    "resolve_mlps",
    "find_attention",
    "find_linear_attention",
    "find_final_norm",
    "find_layer_stack",
    "find_norms",
    "is_linear_like",
    "unregister_adapter",
    "unwrap_model",
]
