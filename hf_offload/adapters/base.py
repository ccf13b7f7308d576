"""What an adapter is: the answer to "which modules are this model's decoder layers, in order"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

FindLayers = Callable[[nn.Module], Sequence[nn.Module]]
FindMLP = Callable[[nn.Module], "nn.Module | None"]


class UnsupportedModelError(ValueError):
    """Raised when no adapter can find a model's decoder layers."""


@dataclass(frozen=True)
class Adapter:
    """`find_layers(model)` returns the decoder layers in forward order; `find_mlp(layer)` a
    decoder layer's MLP, for sequence tiling (None: the generic finder, `find_mlp`)."""

    model_type: str
    find_layers: FindLayers
    find_mlp: FindMLP | None = None


def unwrap_model(model: object) -> nn.Module:
    """The transformers model inside a PEFT, DDP or DataParallel wrapper, or the model itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"expected a torch.nn.Module such as a transformers PreTrainedModel, got {type(model).__name__}"
        )
    if type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
        getattr(model, "module", None), nn.Module
    ):
        model = model.module
    get_base_model = getattr(type(model), "get_base_model", None)
    if callable(get_base_model):  # peft.PeftModel
        return model.get_base_model()
    return model


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding `.layers`: what `get_decoder()` returns, or the model itself."""
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        decoder = get_decoder()
        if decoder is not None:
            return decoder
    return model


# Attributes through which wrappers reach the module they run. FSDP1 gathers the parameters and
# torch.compile's OptimizedModule runs the same layer: offloading wraps the module inside them,
# where the gathered parameters are live. torch.distributed's checkpoint_wrapper is wrapped itself:
# offloading must stay outside the checkpoint to see only its inputs.
_RUNS_INNER = ("_fsdp_wrapped_module", "_orig_mod")
_CHECKPOINTS_INNER = "_checkpoint_wrapped_module"


def _inner(module: nn.Module, attributes: tuple[str, ...]) -> nn.Module | None:
    # The module's own children only: CheckpointWrapper forwards unknown attribute lookups to
    # the module inside it, so getattr would see through it to an FSDP1 unit it holds.
    children = module._modules
    for attribute in attributes:
        inner = children.get(attribute)
        if inner is not None:
            return inner
    return None


def hook_point(layer: nn.Module) -> nn.Module:
    """The module whose forward hf_offload wraps for a decoder layer as listed in the model."""
    while (inner := _inner(layer, _RUNS_INNER)) is not None:
        layer = inner
    return layer


def innermost(layer: nn.Module) -> nn.Module:
    """The decoder layer itself, inside every wrapper (what the class checks look at)."""
    while (inner := _inner(layer, (*_RUNS_INNER, _CHECKPOINTS_INNER))) is not None:
        layer = inner
    return layer


def layers_of_class(*class_names: str) -> FindLayers:
    """A `find_layers` for families whose decoder stack keeps its layers in `.layers`, checked
    by class name so that a renamed or restructured model fails loudly instead of silently."""

    def find_layers(model: nn.Module) -> Sequence[nn.Module]:
        stack = decoder_stack(model)
        layers = getattr(stack, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise UnsupportedModelError(
                f"{type(model).__name__}: expected decoder layers in {type(stack).__name__}.layers, found none"
            )
        # By class hierarchy, not exact class: FSDP2's fully_shard swaps each layer's class for a
        # generated subclass (FSDPLlamaDecoderLayer).
        wanted = set(class_names)
        wrong = sorted(
            {
                type(innermost(layer)).__name__
                for layer in layers
                if not wanted & {c.__name__ for c in type(innermost(layer)).__mro__}
            }
        )
        if wrong:
            raise UnsupportedModelError(
                f"{type(model).__name__}: expected decoder layers of class {' or '.join(class_names)}, found {wrong}"
            )
        return list(layers)

    return find_layers


# What decoder layers call their per-token feed-forward block, in the order they are looked for
# (transformers 5.x: `mlp` in most families, `feed_forward` in Llama 4, Jamba and others,
# `block_sparse_moe` in Granite MoE, `ffn` in DBRX and MPT, `mlp_block` in RecurrentGemma,
# `shared_mlp` in Granite MoE hybrid's layers without experts).
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "mlp_block", "shared_mlp")
# Feed-forward blocks that mix tokens, so that a slice of the sequence is not computed from its
# own tokens alone: RWKV's shifts to the previous token, Doge's CDMoE reshapes across tokens.
TOKEN_MIXING = frozenset({"RwkvFeedForward", "DogeCDMoE"})


def find_mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's MLP: its first child named as in MLP_NAMES that is per token, or None."""
    children = innermost(layer)._modules
    for name in MLP_NAMES:
        module = children.get(name)
        if module is not None:
            return None if type(module).__name__ in TOKEN_MIXING else module
    return None


# What decoder layers call their attention block: its projections in and out are per token.
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")


def find_norms(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's normalisations (RMSNorm, LayerNorm: per token), by class: torch's, or a
    class whose name ends in Norm (LlamaRMSNorm, not RobertaPreLayerNormAttention). Its own, and
    its attention module's own (Qwen3's and Gemma3's q_norm and k_norm over each head, OLMo2's over
    the projections, DeepSeek's q_a_layernorm): their float32 work is as large as the layer's."""
    attention = find_attention(layer)
    owners = [innermost(layer)] + ([innermost(attention)] if attention is not None else [])
    return [module for owner in owners for module in owner._modules.values() if module is not None and is_norm(module)]


def is_norm(module: nn.Module) -> bool:
    """torch's norms, or a class whose name ends in Norm (LlamaRMSNorm, not RobertaPreLayerNormAttention)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _layer_list_position(model: nn.Module, layers: Sequence[nn.Module]) -> tuple[nn.Module, int] | None:
    """The module holding the decoder layers' list (LlamaModel, GPT-2's transformer), and the
    list's place among its children."""
    first = layers[0] if layers else None
    for stack in model.modules():
        for index, child in enumerate(stack._modules.values()):
            if isinstance(child, nn.ModuleList) and any(hook_point(item) is first for item in child):
                return stack, index
    return None


def find_layer_stack(model: nn.Module, layers: Sequence[nn.Module]) -> nn.Module | None:
    """The module whose forward runs the decoder layers (the one holding their list), or None."""
    found = _layer_list_position(model, layers)
    return None if found is None else found[0]


def find_final_norm(model: nn.Module, layers: Sequence[nn.Module]) -> nn.Module | None:
    """The norm between the last decoder layer and lm_head: the one norm the module holding the
    layers registers after their list (LlamaModel.norm, GPT-2's ln_f). None where there is not
    exactly one."""
    found = _layer_list_position(model, layers)
    if found is None:
        return None
    stack, index = found
    children = list(stack._modules.values())
    norms = [module for module in children[index + 1 :] if module is not None and is_norm(module)]
    return norms[0] if len(norms) == 1 else None


def find_attention(layer: nn.Module) -> nn.Module | None:
    children = innermost(layer)._modules
    return next((children[name] for name in ATTENTION_NAMES if children.get(name) is not None), None)


# Where Gated DeltaNet layers (Qwen3.5, Qwen3-Next and their kin) keep their linear attention.
LINEAR_ATTENTION_NAMES = ("linear_attn",)


def find_linear_attention(layer: nn.Module) -> nn.Module | None:
    """The layer's linear-attention block, whose projections are per token (its convolution and
    recurrence are not), or None."""
    children = innermost(layer)._modules
    return next((children[name] for name in LINEAR_ATTENTION_NAMES if children.get(name) is not None), None)


def is_linear_like(module: nn.Module) -> bool:
    """A linear map applied to each token: nn.Linear, or an adapter around one (PEFT's LoRA and
    DoRA layers keep it as `base_layer`)."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)
