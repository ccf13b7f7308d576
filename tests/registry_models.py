"""Tiny random-weight models of every causal-LM type transformers registers, for the registry sweep
(tests/test_registry.py): each type's default config, shrunk generically, then a few per-type fix-ups."""

from __future__ import annotations

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 128
LAYERS = 2

# Set wherever a config has the attribute (directly or through its attribute_map).
SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=VOCAB, max_position_embeddings=128,
    # Other names for the same (configs whose attribute_map does not translate them).
    n_embd=32, d_model=32, n_layer=LAYERS, n_layers=LAYERS, num_layers=LAYERS, decoder_layers=LAYERS,
    encoder_layers=LAYERS, n_head=4, n_heads=4, decoder_attention_heads=4, encoder_attention_heads=4,
    n_positions=128, ffn_dim=64, decoder_ffn_dim=64, encoder_ffn_dim=64, d_ff=64, d_inner=64, dff=64,
    num_decoder_layers=LAYERS, num_encoder_layers=LAYERS, num_decoder_attention_heads=4, num_encoder_attention_heads=4,
    dim_head=8, dim_ff=64, swa_head_dim=8, intermediate_size_mlp=64, dense_intermediate_size=64, o_lora_rank=16,
    # Mixture of experts.
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2,
    n_shared_experts=1, n_group=1, topk_group=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_experts_intermediate_size=32, moe_shared_expert_intermediate_size=32, shared_intermediate_size=32,
    expert_ffn_hidden_size=32,
    # Multi-head latent attention, linear attention, indexers.
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=8,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=8,
    linear_num_heads=4, index_head_dim=8, index_n_heads=2, index_num_heads=2, index_topk=8,
    # State-space layers.
    state_size=8, mamba_d_state=8, ssm_state_size=8, time_step_rank=8, mamba_dt_rank=8, mamba_n_heads=4,
    mamba_d_head=16, mamba_d_ssm=64, mamba_chunk_size=16, chunk_size=16, num_heads=4,
    n_groups=1, mamba_num_heads=4, mamba_head_dim=16, adapter_rank=8, router_hidden_size=16, hc_lowrank=8,
    # Extra embeddings.
    unpadded_vocab_size=VOCAB, input_embedding_size=32, output_embedding_size=32, pronunciation_embed_dim=8,
    shape_embed_dim=8,
    # Per-layer embeddings (Gemma 3n, Gemma 4).
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=4,
    # Vision and audio towers: built, and run by git only (no other type gets pixel or audio inputs).
    image_size=32, patch_size=8, vision_output_dim=32, out_hidden_size=32, depth=LAYERS, adapter_in_dim=32,
    adapter_input_size=32, adapter_out_dim=32, hidden_size_global=32,
)  # fmt: skip
# Probabilities of random draws in training, all zeroed: tiling changes how many draws there are.
RANDOM = ("dropout", "pdrop", "layerdrop", "jitter", "drop_path")
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def _sub_configs(config: PreTrainedConfig) -> dict[str, PreTrainedConfig]:
    return {name: value for name, value in vars(config).items() if isinstance(value, PreTrainedConfig)}


def _has(config: PreTrainedConfig, name: str) -> bool:
    return name in config.attribute_map or name in vars(config)


def _layer_count(config: PreTrainedConfig) -> int | None:
    try:
        count = config.num_hidden_layers
    except AttributeError:
        return None
    return count if isinstance(count, int) else None


def _layer_kinds(config: PreTrainedConfig) -> dict[str, list[str]]:
    """Each per-layer list of names (layer_types, mlp_layer_types...) as its distinct kinds, so that
    a tiny model still has a layer of each kind."""
    count = _layer_count(config)
    return {
        name: list(dict.fromkeys(value))
        for name, value in vars(config).items()
        if isinstance(value, list) and len(value) == count and value and all(isinstance(v, str) for v in value)
    }


def shrunk(config: PreTrainedConfig, dropout: float = 0.0, sizes: dict = SIZES) -> dict:
    """Keyword arguments that rebuild `config` tiny (sub-configs as dicts, shrunk in turn), so that
    what each config derives from its sizes (layer types, head dims) is derived again."""
    kwargs: dict = {name: value for name, value in sizes.items() if _has(config, name)}
    kinds = _layer_kinds(config)
    if kinds:
        layers = max(LAYERS, *(len(k) for k in kinds.values()))
        kwargs.update({name: (k * layers)[:layers] for name, k in kinds.items()})
        if _has(config, "num_hidden_layers"):
            kwargs["num_hidden_layers"] = layers
    for name, value in vars(config).items():
        if isinstance(value, float) and any(word in name for word in RANDOM):
            kwargs[name] = dropout if "dropout" in name or "pdrop" in name else 0.0
    for name in SPECIAL_TOKENS:
        value = getattr(config, name, None) if _has(config, name) else None
        if isinstance(value, int) and value >= VOCAB:
            kwargs[name] = VOCAB - 1
        elif isinstance(value, list):
            kwargs[name] = [VOCAB - 1 if token >= VOCAB else token for token in value]
    if _has(config, "output_router_logits"):
        kwargs["output_router_logits"] = True  # the load-balancing loss joins the loss, and weighs in
        if _has(config, "router_aux_loss_coef"):
            kwargs["router_aux_loss_coef"] = 1.0
    if _has(config, "kv_lora_rank"):
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]  # latent attention has no grouped heads
    for name, sub in _sub_configs(config).items():
        sub_kwargs = shrunk(sub, dropout, sizes)
        kwargs[name] = {"model_type": sub.model_type, **sub_kwargs} if sub.model_type else sub_kwargs
    return kwargs


# Dots 3's sliding-window layers take their sizes from swa_* arguments (into its per_layer_config).
_DOTS3_SLIDING = dict(
    swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16, swa_head_dim=16,
    swa_qk_nope_head_dim=8, swa_v_head_dim=8,
)  # fmt: skip
_QWEN4_INDEXER = dict(
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4
)  # fmt: skip
# Per type: keyword arguments on top of the shrunk ones (sub-configs as nested dicts), where the
# generic shrinking gets it wrong or the default config leaves something unset or untrainable.
FIXUPS: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1]),  # else no attention layer, and no cache that can tell the length
    # use_cache=True fails in training: its cache asks BltConfig for num_hidden_layers, which it has not.
    "blt": dict(use_cache=False, encoder_hash_byte_group_vocab=64),
    "codegen": dict(rotary_dim=4),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_theta": 10000.0, "rope_type": "default"}}),
    "dbrx": dict(  # clip_qkv=None (the default) makes its attention call clamp(min=None, max=None), which raises
        attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "dots3_note": dict(text_config=_DOTS3_SLIDING),
    "dots3_note_text": _DOTS3_SLIDING,
    "flint": dict(mlp_only_layers=[0]),  # with no MoE layer, the load-balancing loss indexes an empty tuple
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "gptj": dict(rotary_dim=4),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=8),  # hidden_size * expand == num_heads * head_dim
    "qwen4_exp": dict(text_config=_QWEN4_INDEXER),
    "qwen4_exp_text": _QWEN4_INDEXER,
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=32, attention_window_size=16),
    "reformer": dict(
        is_decoder=True,
        attn_layers=["local", "lsh"],
        attention_head_size=8,
        feed_forward_size=64,
        # Training needs the axial positions to multiply to the sequence length (32 tokens here).
        axial_pos_shape=[4, 8],
        axial_pos_embds_dim=[16, 16],
        local_attn_chunk_length=8,
        lsh_attn_chunk_length=8,
        num_buckets=4,
        hash_seed=0,  # else LSH draws its random rotations from the OS's entropy at each forward
    ),  # fmt: skip
    # Its config's head dims round up to multiples of 64, its layers' do not; use_cache=True fails backward.
    "xlstm": dict(hidden_size=64, qk_dim_factor=1.0, use_cache=False),
    # Hybrid layers share one block (tied weights), which needs two of them.
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
}

# Types whose default config does not validate as it is.
UNBUILDABLE_DEFAULTS: dict[str, dict] = {
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
}


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


# What a config's own validation may ask of the sizes (Kolibri 1.1's NVFP4 rounding of keys and values
# wants head_dim a multiple of 16): the sizes tried after SIZES, the widths doubled, the counts kept.
WIDER = {
    name: value * 2
    for name, value in SIZES.items()
    if name not in ("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input", "max_position_embeddings",
                    "n_positions", "image_size", "patch_size")
    and not any(word in name for word in ("layer", "head", "expert", "topk", "top_k", "group", "depth", "per_tok"))
    or name in ("head_dim", "dim_head", "swa_head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim",
                "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
                "mamba_d_head", "mamba_head_dim")
}  # fmt: skip


class ConfigRefused(Exception):
    """A type whose config's own validation refuses every size set the sweep tries."""


def tiny_config(model_type: str, dropout: float = 0.0) -> PreTrainedConfig:
    """The type's config at SIZES, or where its own validation refuses those, at the WIDER ones."""
    default = AutoConfig.for_model(model_type, **UNBUILDABLE_DEFAULTS.get(model_type, {}))
    fixes = {**UNBUILDABLE_DEFAULTS.get(model_type, {}), **FIXUPS.get(model_type, {})}
    refusals = []
    for sizes in (SIZES, {**SIZES, **WIDER}):
        kwargs = _merge(shrunk(default, dropout, sizes), fixes)
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except (ValueError, TypeError, StrictDataclassError) as error:  # TypeError: an unknown keyword
            refusals.append(f"{type(error).__name__}: {error}")
    raise ConfigRefused(
        f"the registry sweep cannot build a tiny {model_type!r}: its config refuses every size set tried "
        f"({' / '.join(refusals)}); give it a FIXUPS entry in tests/registry_models.py"
    )


# Types whose causal LM is the decoder of a composite config.
DECODER_ONLY = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def tiny_model(model_type: str, seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    """With `dropout`, every dropout probability the config has (hidden, attention, residual,
    embedding) and every nn.Dropout; other random draws (layer drop, router jitter) stay off."""
    config = tiny_config(model_type, dropout)
    torch.manual_seed(seed)
    if model_type in DECODER_ONLY:
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        model = model_class(getattr(config, DECODER_ONLY[model_type]))
    else:
        model = AutoModelForCausalLM.from_config(config)
    if model_type == "xmod":
        model.set_default_language("en_XX")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout  # some are not configurable
    return model.train()


def inputs(model: torch.nn.Module, batch: int, seq: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A training batch of random tokens, labels = inputs."""
    generator = torch.Generator().manual_seed(seed)
    codebooks = getattr(model.config, "num_codebooks", None) if model.config.model_type.startswith("musicgen") else None
    if codebooks:  # a sequence per codebook, labels (batch, seq, codebooks); its pad token (VOCAB - 1) is not a label
        ids = torch.randint(0, VOCAB - 1, (batch * codebooks, seq), generator=generator)
        return {"input_ids": ids, "labels": ids.view(batch, codebooks, seq).transpose(1, 2)}
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    extra = {}
    if model.config.model_type == "git":  # an image captioner: its loss skips the image's tokens, which must be there
        vision = model.config.vision_config
        extra["pixel_values"] = torch.randn(batch, 3, vision.image_size, vision.image_size, generator=generator)
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        # Padding at the end of the first sequence: the load-balancing loss leaves its rows out, so the
        # rows it is given must be in token order (5 tokens: no whole slice, whichever the slicing).
        extra["attention_mask"] = torch.ones_like(ids)
        extra["attention_mask"][0, -5:] = 0
    return {"input_ids": ids, "labels": ids, **extra}
