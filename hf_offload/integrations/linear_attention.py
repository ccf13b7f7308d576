"""Token mixers that are not softmax attention, under DeepSpeed's Ulysses.

Ulysses exchanges tokens for heads around the softmax attention kernel only (transformers'
`ALL_ATTENTION_FUNCTIONS`). Every other part of the model runs on each rank's shard of the
sequence, which is right for what is per token (projections, MLPs, norms) and silently wrong for
what mixes tokens some other way: a linear-attention recurrence, a state-space (Mamba) scan, a
causal convolution. Those layers would see only their own shard.

What this module does about them:

- `token_mixers(model)` finds them: in each decoder layer, a module that mixes tokens outside
  softmax attention (a causal `nn.Conv1d` along the sequence, a class whose name says linear
  attention, a state-space or recurrent mixer, or a `layer_types` entry that is not attention).
- Gated DeltaNet of Qwen3.5 (dense and MoE) and Qwen3-Next runs exactly across the SP group
  (`prepare_linear_attention`): its per-token projections run on the rank's shard; an all-to-all
  then trades the sequence for heads, so that each rank runs the causal depthwise convolution and
  the gated delta recurrence of `heads / sp_size` heads over the whole sequence; a second
  all-to-all trades the output back, and the gated norm and output projection run on the shard
  again. Its heads are independent (each value head reads one query/key head) and its
  convolution is per channel, so the split changes nothing: exactly one process's arithmetic, the
  same functions transformers calls (flash-linear-attention's and causal-conv1d's kernels where
  installed, their torch fallbacks otherwise). It needs `sp_size` to divide
  `linear_num_key_heads`.
- Every other such mixer is refused by `check_sequence_parallel` and `register_ulysses`, naming
  its class, its layer type and its layers (`check_token_mixers`).

The exchange runs exactly when Ulysses's attention exchange runs: a DeepSpeed Ulysses attention
is registered in transformers (by `register_ulysses`, or by accelerate's or the Trainer's
`prepare`), and the layer is in training mode or that registration stays on in eval mode
(`disable_in_eval=False`).
"""

from __future__ import annotations

import functools
import re
import sys
import types
from dataclasses import dataclass

import torch
from torch import nn

from .upstream import resolve

# The per-layer kinds (`layer_types`, `layers_block_type`) Ulysses runs right: softmax attention, which it
# exchanges, and per-token blocks (Nemotron-H's MLP and MoE layers).
ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe"}
)
# Class names of modules that mix tokens without softmax attention (case-sensitive: SeedOssMLP is an MLP).
_MIXER_NAME = re.compile(
    r"(Mamba|Mixer|SSM|DeltaNet|DeltaAttention|LinearAttention|Lightning|ShortConv|Recurrent|Rwkv|RWKV|RgLru|RGLRU"
    r"|Retention|Hyena)"
)
# Gated DeltaNet classes run exactly across the SP group: {class qualname: projection layout}.
EXACT_GATED_DELTANET = {
    "Qwen3_5GatedDeltaNet": "qkv",
    "Qwen3_5MoeGatedDeltaNet": "qkv",
    "Qwen3NextGatedDeltaNet": "qkvz",
}
# What transformers' modeling module of each must provide (looked up at each call, as its forward does).
_MODELING_FUNCTIONS = ("apply_mask_to_padding_states", "causal_conv1d_fn", "torch_chunk_gated_delta_rule")
# Config model types whose every non-attention layer is such a Gated DeltaNet (for a config without a model).
EXACT_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})
PREPARED_ATTR = "_hf_offload_ulysses_linear_attention"


@dataclass(frozen=True)
class TokenMixer:
    """A module of a decoder layer that mixes tokens outside softmax attention."""

    name: str  # the module's qualified name in the model
    layer: int | None  # the decoder layer's index
    kind: str  # its class name
    layer_type: str | None  # the config's name for the layer's kind (layer_types), if any
    exact: bool  # whether it runs exactly across the SP group (a known Gated DeltaNet)


def _layer_types(config) -> list[str] | None:
    for attribute in ("layer_types", "layers_block_type"):
        value = getattr(config, attribute, None)
        if isinstance(value, (list, tuple)) and value and all(isinstance(kind, str) for kind in value):
            return list(value)
    return None


def _layer_index(name: str) -> int | None:
    """The decoder layer's index in a module name such as 'model.layers.3.linear_attn'."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def _is_causal_conv(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1


def is_exact_gated_deltanet(module: nn.Module) -> bool:
    """Whether `module` is a Gated DeltaNet this module runs exactly across the SP group."""
    layout = EXACT_GATED_DELTANET.get(type(module).__qualname__)
    if layout is None or not type(module).__module__.startswith("transformers.models."):
        return False
    modeling = sys.modules.get(type(module).__module__)
    return modeling is not None and all(callable(getattr(modeling, name, None)) for name in _MODELING_FUNCTIONS)


def _decoder_layers(model: nn.Module) -> list[nn.Module] | None:
    """The model's decoder layers in order (through DDP, DeepSpeed, PEFT wrappers), or None."""
    from ..adapters import resolve_layers, unwrap_model

    inner, seen = model, 0
    while isinstance(getattr(inner, "module", None), nn.Module) and seen < 8:
        inner, seen = inner.module, seen + 1
    try:
        return list(resolve_layers(unwrap_model(inner))[1])
    except Exception:  # no decoder layers found: judged by module names
        return None


def _says_mixer(module: nn.Module, family: str) -> bool:
    """Whether the class name, without the model family's prefix (RecurrentGemma's RMSNorm is a
    norm), names a token mixer."""
    name = type(module).__name__
    if family and name.startswith(family):
        name = name[len(family) :]
    return bool(_MIXER_NAME.search(name))


def _mixers_in(root: nn.Module, family: str = "") -> list[tuple[str, nn.Module]]:
    """The outermost modules under `root` whose class says they mix tokens (or a Gated DeltaNet);
    then, for a causal convolution inside none of them, the child of `root` that holds it (Kimi's
    delta attention, named as attention). `family`: the model's class-name prefix."""
    named: list[tuple[str, nn.Module]] = []

    def inside(name: str) -> bool:
        return any(name == outer or name.startswith(outer + ".") for outer, _ in named)

    for name, module in root.named_modules():
        if name and not inside(name) and (is_exact_gated_deltanet(module) or _says_mixer(module, family)):
            named.append((name, module))
    for name, module in root.named_modules():
        if name and not inside(name) and _is_causal_conv(module):
            child = name.split(".")[0]
            named.append((child, root.get_submodule(child)))
    return named


def config_of(model: object):
    """The transformers config of a model, through PEFT, DDP, FSDP and DeepSpeed engine wrappers
    (or a config itself)."""
    seen = 0
    while seen < 8:
        if hasattr(model, "get_text_config") and hasattr(model, "model_type"):  # a config
            return model
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            return config
        inner = getattr(model, "module", None)
        if inner is None:
            break
        model, seen = inner, seen + 1
    raise TypeError(
        f"sequence parallelism needs a transformers model (or its config), got {type(model).__name__} "
        "without a transformers config"
    )


def token_mixers(model: nn.Module) -> list[TokenMixer]:
    """The modules of `model`'s decoder layers that mix tokens outside softmax attention,
    outermost only (a Mamba mixer, not its convolution as well), in model order."""
    config = config_of(model)
    text = config.get_text_config()
    kinds = _layer_types(text)
    family = type(config).__name__.removesuffix("Config")
    layers = _decoder_layers(model)
    if layers is not None:
        places = [(index, f"layer {index}.", layer) for index, layer in enumerate(layers)]
    else:
        places = [(None, "", model)]
    found: list[TokenMixer] = []
    for position, prefix, root in places:
        for name, module in _mixers_in(root, family):
            index = position if position is not None else _layer_index(name)
            if index is None:  # outside the decoder layers (a vision tower's patch embedding)
                continue
            layer_type = kinds[index] if kinds is not None and index < len(kinds) else None
            exact = is_exact_gated_deltanet(module)
            found.append(TokenMixer(prefix + name, index, type(module).__name__, layer_type, exact))
    # A layer the config calls something other than attention, where no module said so itself.
    if kinds is not None:
        seen = {mixer.layer for mixer in found}
        count = len(layers) if layers is not None else len(kinds)
        for index, kind in enumerate(kinds[:count]):
            if kind not in ATTENTION_LAYER_TYPES and index not in seen:
                found.append(TokenMixer(f"layer {index}", index, kind, kind, False))
    return found


def _group(mixers: list[TokenMixer]) -> list[tuple[str, str | None, list[int]]]:
    groups: dict[tuple[str, str | None], list[int]] = {}
    for mixer in mixers:
        groups.setdefault((mixer.kind, mixer.layer_type), []).append(mixer.layer)
    return [(kind, layer_type, sorted(set(layers))) for (kind, layer_type), layers in groups.items()]


def _describe(mixers: list[TokenMixer]) -> str:
    parts = []
    for kind, layer_type, layers in _group(mixers):
        named = f"{kind} ({layer_type!r} layers)" if layer_type and layer_type != kind else kind
        parts.append(f"{named} in layers {layers}")
    return "; ".join(parts)


def _key_heads(model_or_config) -> int | None:
    heads = getattr(config_of(model_or_config).get_text_config(), "linear_num_key_heads", None)
    return heads if isinstance(heads, int) else None


def check_token_mixers(model_or_config, sp_size: int) -> list[TokenMixer]:
    """Raise a ValueError naming every token mixer Ulysses would run on each rank's shard alone
    (its class, its layer type, its layers, and what would work); for the Gated DeltaNet run
    exactly, that `sp_size` divides its key heads. A config (no modules to look at) is judged by
    its `layer_types`. Returns the mixers found (all exact, if it returns)."""
    config = config_of(model_or_config)
    if isinstance(model_or_config, nn.Module):
        mixers = token_mixers(model_or_config)
    else:
        text = config.get_text_config()
        kinds = _layer_types(text) or []
        exact = getattr(text, "model_type", None) in EXACT_MODEL_TYPES or config.model_type in EXACT_MODEL_TYPES
        mixers = [
            TokenMixer(f"layer {i}", i, kind, kind, exact and kind == "linear_attention")
            for i, kind in enumerate(kinds)
            if kind not in ATTENTION_LAYER_TYPES
        ]
    refused = [mixer for mixer in mixers if not mixer.exact]
    if refused:
        raise ValueError(
            f"sequence parallelism (Ulysses) on {type(config).__name__}: {_describe(refused)} mix(es) tokens outside "
            "softmax attention, and Ulysses exchanges only softmax attention, so each rank's would see only its own "
            "shard of the sequence (a silently different model). hf_offload runs only the Gated DeltaNet of Qwen3.5 "
            "(dense and MoE) and Qwen3-Next exactly across the ranks. Train this model without sp_size: on one GPU "
            "with checkpointing + hf_offload + sequence tiling, or with the ranks as data parallel (DDP, FSDP, ZeRO-3)"
        )
    exact = [mixer for mixer in mixers if mixer.exact]
    heads = _key_heads(model_or_config)
    if exact and (heads is None or heads % sp_size):
        valid = [size for size in range(2, (heads or 0) + 1) if heads % size == 0]
        raise ValueError(
            f"sp_size={sp_size} does not divide linear_num_key_heads={heads}: under Ulysses each rank runs "
            f"linear_num_key_heads / sp_size key heads of {_describe(exact)} over the whole sequence; valid sp_size "
            f"for these layers: {valid or 'none'}"
        )
    return mixers


# Whether this forward runs Ulysses's exchange at all, where something narrower than "Ulysses is
# registered" decides: register_ulysses's shard rule (`hf_offload.integrations.sequence_parallel`,
# which sets it; this module does not import that one). Called with the position_ids the decoder
# layer holding the Gated DeltaNet was given (the same tensor in a checkpoint's recompute).
_FORWARD_RULE: list = []  # [callable(position_ids) -> bool]
_LAYER_POSITIONS: dict = {}  # id(the Gated DeltaNet) -> the position_ids its decoder layer was given


def set_forward_rule(rule) -> None:
    """`rule(position_ids)` decides, per forward, whether the Gated DeltaNets run across the ranks;
    None removes it (then: whenever Ulysses's attention is registered)."""
    _FORWARD_RULE[:] = [] if rule is None else [rule]


def _record_positions(mixer: nn.Module, layer: nn.Module, args, kwargs) -> None:
    _LAYER_POSITIONS[id(mixer)] = kwargs.get("position_ids")


def prepare_linear_attention(model: nn.Module, sp_size: int) -> int:
    """Check `model`'s token mixers for Ulysses over `sp_size` ranks (`check_token_mixers`), then
    make each Gated DeltaNet run across the SP group whenever Ulysses's attention exchange runs (an
    instance-level `forward`; outside Ulysses it calls the class's own). Idempotent. Returns how
    many layers it prepared."""
    if not isinstance(model, nn.Module):
        return 0
    check_token_mixers(model, sp_size)
    count = 0
    layers = _decoder_layers(model) or []
    for module in model.modules():
        if is_exact_gated_deltanet(module):
            if not getattr(module, PREPARED_ATTR, False):
                module.forward = types.MethodType(_forward_across_ranks, module)
                holders = [layer for layer in layers if any(child is module for child in layer.modules())]
                handles = [
                    layer.register_forward_pre_hook(functools.partial(_record_positions, module), with_kwargs=True)
                    for layer in holders[:1]
                ]
                setattr(module, PREPARED_ATTR, handles)
            count += 1
    return count


def release_linear_attention(model: nn.Module) -> None:
    """Put the class's own forward back on every layer `prepare_linear_attention` changed."""
    for module in model.modules():
        handles = getattr(module, PREPARED_ATTR, False)
        if handles is not False:
            module.__dict__.pop("forward", None)
            for handle in handles if isinstance(handles, list) else ():
                handle.remove()
            _LAYER_POSITIONS.pop(id(module), None)
            delattr(module, PREPARED_ATTR)


@dataclass(frozen=True)
class Exchange:
    """The SP group of the Ulysses attention in force: its process group, size and this rank."""

    group: object
    size: int
    rank: int


ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"


def ulysses_of(wrapper, kind: type):
    """The `UlyssesSPAttentionHF` DeepSpeed's registered wrapper calls (held in its closure:
    DeepSpeed returns only the mpu), or None."""
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, kind):
            return value
    return None


def active_exchange(module: nn.Module) -> Exchange | None:
    """The exchange Ulysses's attention would run now for a module in `module.training` mode: the
    registered DeepSpeed Ulysses attention's group, or None (none registered, or registered off in
    eval mode and the module is in eval mode)."""
    if resolve("deepspeed.sequence_parallel_group") is None:
        return None
    if ULYSSES_MODULE not in sys.modules:
        return None
    kind = resolve("deepspeed.ulysses_attention")
    for registered in list(resolve("transformers.local_attention_functions").values()):
        wrapper = getattr(registered, "_hf_offload_exchange", registered)  # register_ulysses's gate: DeepSpeed's behind
        if getattr(wrapper, "__module__", None) != ULYSSES_MODULE:
            continue
        instance = ulysses_of(wrapper, kind)
        if instance is None:
            continue
        if not module.training and instance.disable_in_eval:
            return None
        if _FORWARD_RULE and not _FORWARD_RULE[0](_LAYER_POSITIONS.get(id(module))):
            return None  # register_ulysses: not a shard (a rank's own rows, generate): the layer runs whole
        return Exchange(instance.process_group, instance.world_size, instance.sp_rank)
    return None


def _all_to_all(exchange: Exchange, tensor: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's all-to-all over dimension 0 (its own autograd: the reverse exchange in backward)."""
    return resolve("deepspeed.all_to_all")(exchange.group, tensor.contiguous())


def _forward_across_ranks(self, hidden_states: torch.Tensor, *args, **kwargs):
    """Gated DeltaNet's forward with its convolution and recurrence over the whole sequence, the
    rank's heads only, where Ulysses's exchange runs; else the class's own forward."""
    exchange = active_exchange(self)
    if exchange is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cache = kwargs.pop("cache", kwargs.pop("cache_params", args[0] if args else None))
    attention_mask = kwargs.pop("attention_mask", args[1] if len(args) > 1 else None)
    where = f"{type(self).__name__} (layer {self.layer_idx})"
    if cache is not None:
        raise ValueError(
            f"{where} under Ulysses got a cache: its convolution and recurrent state would be each rank's heads' "
            "over the whole sequence, not what generation reads. Train with use_cache=False; generate without "
            "sequence parallelism"
        )
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError(
            f"{where} under Ulysses got cu_seq_lens_q (packed documents): each rank's boundaries are its shard's. "
            "Use one document per row"
        )
    return _gated_deltanet_across_ranks(self, hidden_states, attention_mask, exchange)


def _gated_deltanet_across_ranks(self, hidden_states, attention_mask, exchange: Exchange) -> torch.Tensor:
    modeling = sys.modules[type(self).__module__]
    size, rank = exchange.size, exchange.rank
    batch, local, _ = hidden_states.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, local):
        raise ValueError(
            f"{type(self).__name__} (layer {self.layer_idx}) under Ulysses got an attention mask of shape "
            f"{tuple(attention_mask.shape)}, not the shard's ({batch}, {local}): pad on the right, labels -100"
        )
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    k_heads, v_heads, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
    if k_heads % size:
        raise ValueError(f"linear_num_key_heads={k_heads} is not divisible by the {size} ranks of the SP group")
    rank_k, rank_v = k_heads // size, v_heads // size

    # Per token, on the shard: the projections, as the class's forward makes them.
    if EXACT_GATED_DELTANET[type(self).__qualname__] == "qkv":
        mixed = self.in_proj_qkv(hidden_states)
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        z = self.in_proj_z(hidden_states).reshape(batch, local, -1, dv)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    else:  # Qwen3-Next: one projection for q, k, v, z and one for b, a, grouped by key head
        query, key, value, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )

    # Sequence for heads: to rank j go key heads j*rank_k.. and value heads j*rank_v.. of every token here.
    pieces = (
        query.reshape(batch, local, size, rank_k * dk),
        key.reshape(batch, local, size, rank_k * dk),
        value.reshape(batch, local, size, rank_v * dv),
        b.reshape(batch, local, size, rank_v),
        a.reshape(batch, local, size, rank_v),
    )
    widths = [piece.shape[-1] for piece in pieces]
    sent = torch.cat(pieces, dim=-1).permute(2, 0, 1, 3)  # [ranks, batch, local, width]
    received = _all_to_all(exchange, sent)  # [ranks (= the sequence's shards in order), batch, local, width]
    whole = received.permute(1, 0, 2, 3).reshape(batch, size * local, -1)
    length = whole.shape[1]
    query, key, value, b, a = torch.split(whole, widths, dim=-1)

    # The causal depthwise convolution of the rank's channels, over the whole sequence.
    key_dim = self.key_dim
    channels = torch.cat(
        [
            torch.arange(rank * rank_k * dk, (rank + 1) * rank_k * dk),
            key_dim + torch.arange(rank * rank_k * dk, (rank + 1) * rank_k * dk),
            2 * key_dim + torch.arange(rank * rank_v * dv, (rank + 1) * rank_v * dv),
        ]
    ).to(self.conv1d.weight.device)
    weight = self.conv1d.weight.index_select(0, channels).squeeze(1)
    bias = self.conv1d.bias.index_select(0, channels) if self.conv1d.bias is not None else None
    mixed = torch.cat([query, key, value], dim=-1).transpose(1, 2)
    mixed = modeling.causal_conv1d_fn(mixed, weight, bias, activation=self.activation).transpose(1, 2)
    query, key, value = torch.split(mixed, [rank_k * dk, rank_k * dk, rank_v * dv], dim=-1)
    query = query.reshape(batch, length, rank_k, dk)
    key = key.reshape(batch, length, rank_k, dk)
    value = value.reshape(batch, length, rank_v, dv)

    heads = slice(rank * rank_v, (rank + 1) * rank_v)
    beta = b.sigmoid()
    g = -self.A_log[heads].float().exp() * nn.functional.softplus(a.float() + self.dt_bias[heads])
    core, _ = modeling.torch_chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True
    )  # [batch, length, rank_v, dv]

    # Heads for sequence: shard j of every head here goes back to rank j.
    sent = core.reshape(batch, size, local, rank_v * dv).permute(1, 0, 2, 3)
    received = _all_to_all(exchange, sent)  # [ranks (= the value heads' groups in order), batch, local, ...]
    core = received.permute(1, 2, 0, 3).reshape(batch * local * v_heads, dv)

    # Per token, on the shard: the gated norm and the output projection.
    core = self.norm(core, z.reshape(-1, dv)).reshape(batch, local, -1)
    return self.out_proj(core)


__all__ = [
    "ATTENTION_LAYER_TYPES",
    "EXACT_GATED_DELTANET",
    "TokenMixer",
    "active_exchange",
    "check_token_mixers",
    "is_exact_gated_deltanet",
    "prepare_linear_attention",
    "release_linear_attention",
    "token_mixers",
]
