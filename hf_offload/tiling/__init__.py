"""Sequence tiling: each decoder layer's MLP and the loss head run one slice of the sequence at a
time, so that their intermediate activations and the logits exist for one slice only.

Independent of activation offloading: alone, with gradient checkpointing, with offloading, or
all three, in any order, before or after `get_peft_model`. Inside a checkpoint's recompute only
the MLP's input is saved, and under the offload scope that input is what gets offloaded.
Disabling restores every module exactly. State lives on the modules it changed: the MLPs and the
causal LM carry an instance-level `forward` and one attribute each.
"""

from __future__ import annotations

import logging

from torch import nn

from ..adapters import resolve_mlps, unwrap_model
from ..config import TilingOptions
from ..integrations.liger import fused_linear_cross_entropy_in_use
from . import loss as loss_tiling
from . import mlp as mlp_tiling

logger = logging.getLogger("hf_offload")


def enable_sequence_tiling(model: nn.Module, **options: object) -> None:
    """Tile the sequence through each decoder layer's MLP and through the loss head.

    Options (keyword-only) are described in `hf_offload.TilingOptions`: `mlp`, `loss`,
    `tile_tokens`. Calling it again reconfigures. The loss head is tiled only where Liger's fused
    linear cross-entropy is not already computing the loss.
    """
    parsed = TilingOptions.from_kwargs(**options)
    target = unwrap_model(model)
    mlps = resolve_mlps(target) if parsed.mlp else []  # raises, naming the class, before anything changes
    head = target.get_output_embeddings() if parsed.loss and hasattr(target, "get_output_embeddings") else None
    disable_sequence_tiling(target)
    if parsed.mlp:
        tile = parsed.tile_tokens or target.config.get_text_config().hidden_size
        found = list({id(module): module for module in mlps if module is not None}.values())
        for module in found:
            mlp_tiling.install(module, tile)
        if not found:
            logger.warning(
                "hf_offload: no per-token MLP found in the decoder layers of %s; only the loss head is tiled "
                "(register_adapter(model_type, find_layers, find_mlp=...) names it)",
                type(target).__name__,
            )
    if parsed.loss:
        if not isinstance(head, nn.Module):
            name = type(target).__name__
            logger.warning("hf_offload: %s has no output embeddings (lm_head): its loss is not tiled", name)
        elif fused_linear_cross_entropy_in_use(target):
            logger.info("hf_offload: Liger's fused linear cross-entropy computes the loss: the loss head is left to it")
        else:
            loss_tiling.install(target, parsed.tile_tokens)


def disable_sequence_tiling(model: nn.Module) -> None:
    """Remove every wrapper and attribute tiling added. A no-op if not enabled."""
    target = unwrap_model(model)
    for module in target.modules():
        if mlp_tiling.MLP_STATE_ATTR in module.__dict__:
            mlp_tiling.uninstall(module)
        if loss_tiling.LOSS_STATE_ATTR in module.__dict__:
            loss_tiling.uninstall(module)


def is_sequence_tiling(model: nn.Module) -> bool:
    """Read from the modules themselves: True when an MLP or the loss head carries the tiling."""
    target = unwrap_model(model)
    return any(mlp_tiling.is_tiled(module) or loss_tiling.is_tiled(module) for module in target.modules())


def _install_model_methods() -> None:
    from transformers import PreTrainedModel

    def enable(self, **options):
        enable_sequence_tiling(self, **options)

    def disable(self):
        disable_sequence_tiling(self)

    enable.__doc__ = enable_sequence_tiling.__doc__
    disable.__doc__ = disable_sequence_tiling.__doc__
    PreTrainedModel.enable_sequence_tiling = enable
    PreTrainedModel.disable_sequence_tiling = disable
    PreTrainedModel.is_sequence_tiling = property(is_sequence_tiling)


__all__ = ["disable_sequence_tiling", "enable_sequence_tiling", "is_sequence_tiling"]
