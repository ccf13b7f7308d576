"""Sequence tiling: the per-token parts of each decoder layer (its MLP, its norms, its attention's
projections) and the loss head run one slice of the sequence at a time, so that their
intermediate activations, float32 copies and logits exist for one slice only.

Independent of activation offloading: alone, with gradient checkpointing, with offloading, or
all three, in any order, before or after `get_peft_model`. Inside a checkpoint's recompute only
each tiled module's input is saved, and under the offload scope that input is what gets
offloaded. Disabling restores every module exactly. State lives on the modules it changed: each
carries an instance-level `forward` (and the attention modules a forward pre-hook) and one
attribute.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass

from torch import nn

from .. import auto_budget
from ..adapters import (
    UnsupportedModelError,
    find_attention,
    find_final_norm,
    find_layer_stack,
    find_linear_attention,
    find_norms,
    is_linear_like,
    resolve_layers,
    resolve_mlps,
    unwrap_model,
)
from ..config import TilingOptions, reject_positional
from ..integrations import sequence_parallel
from ..integrations.kernels import check_kernel_funcs
from ..integrations.liger import fused_linear_cross_entropy_in_use
from ..integrations.transformers_outputs import check_output_collector
from ..integrations.upstream import announce, present, resolve
from . import attention as attention_tiling
from . import loss as loss_tiling
from . import per_token

logger = logging.getLogger("hf_offload")

# DeepSpeed's Ulysses runs a chunk of query heads at a time through its exchange where attention is
# tiled over heads (`integrations.sequence_parallel.adopt_ulysses`, on tiling's own head chunks),
# under any registration: hf_offload's `register_ulysses`, or accelerate's and the Trainer's, which
# never import that module. Attention tiling knows no Ulysses: plugged in here, through its seam.
attention_tiling.register_outer_attention(
    "deepspeed_ulysses", before_block=sequence_parallel.adopt_ulysses, released=sequence_parallel.release_ulysses
)

TILED_MODULES_ATTR = "_hf_offload_tiled_modules"


def enable_sequence_tiling(model: nn.Module, *positional: object, **options: object) -> None:
    """Tile the sequence through each decoder layer's per-token parts and through the loss head.

    Options (keyword-only) are described in `hf_offload.TilingOptions`: `mlp`, `norms`,
    `projections`, `attention`, `loss`, `tile_tokens`, `tile_heads`. Calling it again reconfigures.
    The loss head is tiled only where Liger's fused linear cross-entropy is not already computing
    the loss. A model with nothing to tile (no decoder layer with a per-token part, no lm_head)
    raises UnsupportedModelError.
    """
    reject_positional("enable_sequence_tiling", positional, TilingOptions.option_names())
    parsed = TilingOptions.from_kwargs(**options)
    target = unwrap_model(model)
    per_layer = parsed.mlp or parsed.norms or parsed.projections or parsed.attention
    _adapter, layers = resolve_layers(target) if per_layer else (None, [])  # raises, naming the class
    check_kernel_funcs(target)
    if parsed.mlp:
        check_output_collector()  # MoE routers' records mended per tile: refused before a step runs
    _announce_what_other_libraries_lack()
    mlps = resolve_mlps(target) if parsed.mlp else []
    head = target.get_output_embeddings() if parsed.loss and hasattr(target, "get_output_embeddings") else None
    disable_sequence_tiling(target)
    tile = parsed.tile_tokens or default_tile_tokens(target)
    modules: dict[int, nn.Module] = {}  # once each: some models share one MLP between layers
    for mlp in mlps:
        if mlp is not None:
            modules[id(mlp)] = mlp
    if parsed.mlp and not modules:
        logger.warning(
            "hf_offload: no per-token MLP found in the decoder layers of %s (register_adapter(model_type, "
            "find_layers, find_mlp=...) names it)",
            type(target).__name__,
        )
    attentions, head_tiled = [], []
    for layer in layers:
        if parsed.norms:
            modules.update((id(norm), norm) for norm in find_norms(layer))
        # A linear-attention block (Gated DeltaNet): its projections run a slice at a time like
        # attention's; its causal convolution, its recurrence and its gated norm (rows of tokens x
        # heads) run whole.
        linear = find_linear_attention(layer)
        if linear is not None and parsed.projections and any(is_linear_like(child) for child in linear.children()):
            attentions.append(linear)
        attention = find_attention(layer)
        if attention is None:
            continue
        if parsed.projections and any(is_linear_like(child) for child in attention.children()):
            attentions.append(attention)
        if parsed.attention:
            head_tiled.append(attention)
    if head_tiled and parsed.tile_heads is not None:
        text = target.config.get_text_config()
        heads = getattr(text, "num_attention_heads", None)
        if isinstance(heads, int):
            kv_heads = getattr(text, "num_key_value_heads", None) or heads
            attention_tiling.check_heads_per_piece(parsed.tile_heads, heads, kv_heads, type(target).__name__)
    if head_tiled:
        resolve("transformers.attn_implementation")
        implementation = getattr(target.config.get_text_config(), "_attn_implementation", None)
        if implementation not in attention_tiling.SPLITTABLE:
            logger.warning(
                "hf_offload: %s computes attention with %r, which sequence tiling does not split over heads "
                "(it splits %s): attention runs with its heads whole",
                type(target).__name__,
                implementation,
                ", ".join(attention_tiling.SPLITTABLE),
            )
            head_tiled = []
    tiles_loss = False
    if parsed.loss:
        if not isinstance(head, nn.Module) or isinstance(head, (nn.ModuleList, nn.ModuleDict)):
            name = type(target).__name__
            logger.warning("hf_offload: %s has no single output embedding (lm_head): its loss is not tiled", name)
        elif fused_linear_cross_entropy_in_use(target):
            logger.info("hf_offload: Liger's fused linear cross-entropy computes the loss: the loss head is left to it")
        else:
            tiles_loss = True
    if not (modules or attentions or head_tiled or tiles_loss):
        raise UnsupportedModelError(
            f"hf_offload: sequence tiling finds nothing to tile in {type(target).__name__}: no decoder layer with a "
            "per-token MLP, norm or attention projection, and no lm_head whose loss it could compute (it is made "
            "for causal language models; register_adapter(model_type, find_layers, find_mlp=...) names the "
            "layers and MLPs of a model it does not know)"
        )
    said: set[str] = set()  # one notice per model, whichever tiled module meets it first
    for attention in attentions:
        per_token.tile_projections(attention, tile, said)
    for attention in head_tiled:
        attention_tiling.install(attention, tile, said, parsed.tile_heads)
    # The final norm is per token too, and its float32 work at the end of the backbone is as large as
    # a layer's norm's: it is tiled as they are wherever it runs (TRL's fused head and Liger's fused
    # cross-entropy take the backbone's last hidden state, so only tiling it on its own reaches
    # them), and chained into the tiled loss head where lm_head takes what it returned.
    final_norm = None
    if parsed.norms and loss_tiling.CHAIN_FINAL_NORM:
        final_norm = find_final_norm(target, layers or resolve_layers(target)[1])
        if final_norm is not None:
            modules.setdefault(id(final_norm), final_norm)
    for module in modules.values():
        per_token.install(module, tile, said)
    _keep_tiled(target, layers, list(modules.values()))
    if tiles_loss:
        loss_tiling.install(target, parsed.tile_tokens, final_norm, said)


def _announce_what_other_libraries_lack() -> None:
    """Where Liger is loaded but its forwards are not where tiling looks for them, say once that its
    loss head goes unrecognised (harmless: its FALLBACK entry in `integrations.upstream`)."""
    if "liger_kernel" in sys.modules and not present("liger-kernel.forwards"):
        announce("liger-kernel.forwards")


@dataclass
class _TiledModules:
    """Tiling's wrappers kept on the modules it tiles. Another library may put a forward of its own
    on one after tiling was enabled, dropping ours (`instance_forward.dropped`): kernels' kernelize
    does so on every norm at every train() / eval() that changes the mode (transformers >= 5.25),
    Liger's instance patches on norms and MLPs. At each call of the module holding the decoder
    layers, before any of them runs, the wrapper goes back on top of whatever replaced it."""

    modules: list[nn.Module]
    model_name: str
    handle: object = None
    said: bool = False


def _reinstate_tiling(kept: _TiledModules, _owner: nn.Module, _args) -> None:
    reinstated = [module for module in kept.modules if per_token.reinstate(module)]
    if reinstated and not kept.said:
        kept.said = True
        logger.info(
            "hf_offload: the forward of %d tiled module(s) of %s (%s) was replaced since tiling was enabled (kernels' "
            "kernelize does so at each train()/eval()): sequence tiling runs them a slice at a time again, through "
            "the new forward",
            len(reinstated),
            kept.model_name,
            type(reinstated[0]).__name__,
        )


def _keep_tiled(target: nn.Module, layers: list, modules: list[nn.Module]) -> None:
    if not modules:
        return
    owner = (find_layer_stack(target, layers) if layers else None) or target
    kept = _TiledModules(modules, type(target).__name__)
    kept.handle = owner.register_forward_pre_hook(functools.partial(_reinstate_tiling, kept))
    setattr(owner, TILED_MODULES_ATTR, kept)


def _stop_keeping_tiled(module: nn.Module) -> None:
    kept = module.__dict__.get(TILED_MODULES_ATTR)
    if kept is not None:
        kept.handle.remove()
        delattr(module, TILED_MODULES_ATTR)



# A gated MLP's slice per token and unit of its width: bf16 intermediates and PEFT's float32 copies of
# the adapters' inputs (17 bytes measured in a QLoRA r=32 step, 4-bit weights dequantized in it).
_MLP_SLICE_BYTES = 16


def default_tile_tokens(model: nn.Module) -> int:
    """Tokens per slice of the layers' parts: hidden_size (ALST's and Liger's tiled MLP), fewer on a
    device whose memory an MLP slice of those would take more than `SLICE_DEVICE_SHARE` of (the
    device the model is on when tiling is enabled; on the CPU, hidden_size)."""
    config = model.config.get_text_config()
    tokens = config.hidden_size
    parameter = next(model.parameters(), None)
    total = None if parameter is None else auto_budget.total_device_memory(parameter.device)
    if total is not None:
        try:
            width = auto_budget.LayerShape.from_config(config).intermediate
        except ValueError:
            return tokens
        tokens = min(tokens, int(total * loss_tiling.SLICE_DEVICE_SHARE) // (width * _MLP_SLICE_BYTES))
    return max(tokens, 1)


def disable_sequence_tiling(model: nn.Module) -> None:
    """Remove every wrapper, hook and attribute tiling added. A no-op if not enabled."""
    target = unwrap_model(model)
    for module in target.modules():
        _stop_keeping_tiled(module)
        per_token.uninstall(module)
        attention_tiling.uninstall(module)
        loss_tiling.uninstall(module)


def is_sequence_tiling(model: nn.Module) -> bool:
    """Read from the modules themselves: True when a part of a layer or the loss head is tiled."""
    target = unwrap_model(model)
    return any(
        per_token.is_tiled(module)
        or per_token.PROJECTIONS_ATTR in module.__dict__
        or attention_tiling.is_tiled(module)
        or loss_tiling.is_tiled(module)
        for module in target.modules()
    )


__all__ = ["disable_sequence_tiling", "enable_sequence_tiling", "is_sequence_tiling"]
