"""Model shapes the tools know by name, as transformers configs (random weights; nothing is
downloaded), and reading a user's own config."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

# What Qwen3.5 and Qwen3-Next share (their published config.json files; see the hybrids' note below):
# the Gated DeltaNet layers' shapes, three of them to one softmax attention layer.
_HYBRID = dict(head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
               rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=["linear_attention"] * 3 + ["full_attention"])
_QWEN3_5 = dict(_HYBRID, vocab_size=248320,
                rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                     mrope_section=[11, 11, 10], mrope_interleaved=True))  # fmt: skip

PRESET_CONFIGS = {
    # Small enough for two CPU cores, shaped like a real Llama (GQA, SwiGLU, RoPE).
    "tiny": dict(model_type="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=2048),
    # Llama-3.2-1B's config.json (1,235,814,400 parameters, tied embeddings).
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    # Meta-Llama-3-8B's config.json (8,030,261,248 parameters).
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    # Llama-3.1-8B's config.json (8,030,261,248 parameters; its RoPE scaled to 131072 positions).
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         tie_word_embeddings=False),
    # Llama-3.3-70B-Instruct's config.json (70,553,706,496 parameters; Llama 3.1's RoPE scaling).
    "llama-3.3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=8192),
                          tie_word_embeddings=False),
    # Qwen3-8B's config.json (8,190,735,360 parameters; q and k normed per head, no biases).
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    # Qwen2-7B's config.json (7,615,616,512 parameters; Qwen2 has biases on q, k and v).
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    # Mistral-7B-v0.3's config.json.
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                       max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None,
                       tie_word_embeddings=False),
    # Gemma-7B's config.json (tied embeddings, head_dim 256).
    "gemma-7b": dict(model_type="gemma", hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
                     max_position_embeddings=8192, tie_word_embeddings=True),
    # Hybrid models: three Gated DeltaNet (linear attention) layers to one of softmax attention. Written
    # from the published config.json files as remembered (nothing can be downloaded here), held against
    # the defaults of transformers 5.25's config classes, which its docstrings name after the same
    # checkpoints; values marked "unsure" could not be checked against the file itself. Only the text
    # model: Qwen3.5's vision tower is not built (a text fine-tune does not run it).
    # Qwen3.5-9B (dense): text_config of its config.json. Sizes = Qwen3_5TextConfig's defaults. Unsure:
    # tie_word_embeddings (false here, as in the class default; the smallest Qwen3.5 sizes tie).
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, **_QWEN3_5),
    # Qwen3.5-35B-A3B (MoE, the one fine-tuned most): text_config of its config.json. Sizes =
    # Qwen3_5MoeTextConfig's defaults (256 experts, 8 routed + 1 shared, expert width 512).
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, **_QWEN3_5),
    # Qwen3-Next-80B-A3B-Instruct's config.json (512 experts, 10 routed + 1 shared, expert width 512,
    # every layer MoE). Unsure: intermediate_size 5120 (unused: no layer is dense here).
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                               vocab_size=151936, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
                               rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                    partial_rotary_factor=0.25),
                               **_HYBRID),
}  # fmt: skip
PRESET_ALIASES = {"1b": "llama-3.2-1b"}


def preset_names() -> list[str]:
    return [*PRESET_CONFIGS, *PRESET_ALIASES]


def preset_config(preset: str):
    """The transformers config of a built-in shape."""
    from transformers import AutoConfig

    name = PRESET_ALIASES.get(preset, preset)
    if name not in PRESET_CONFIGS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(preset_names())}")
    options = copy.deepcopy(PRESET_CONFIGS[name])  # a config may change its nested dicts (rope parameters)
    if "layer_types" in options:  # a hybrid's repeating pattern, as long as the model is deep
        pattern = options["layer_types"]
        options["layer_types"] = [pattern[i % len(pattern)] for i in range(options["num_hidden_layers"])]
    return AutoConfig.for_model(options.pop("model_type"), **options)


class ConfigError(ValueError):
    """A model config the tools cannot use: names the file or id and what is wrong."""


# A hub id: "name" or "org/name" (what huggingface_hub accepts as a repo id, roughly).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_model_argument(model: str) -> str:
    """The checks of a model's name that need no import, before the command loads anything: a
    local directory with a config.json that is a JSON object with a model_type (or that
    config.json itself), else something shaped like a hub id ("name" or "org/name"). A path
    that does not exist is said to be one, not taken for a hub id. Returns `model`."""
    path = Path(model).expanduser()
    if path.is_dir():
        read_config_file(path / "config.json")
    elif path.is_file():
        read_config_file(path)
    elif _looks_like_a_path(model):
        raise ConfigError(
            f"{model!r}: no such directory (a local model is a directory holding its config.json; a hub id is "
            "'name' or 'org/name')"
        )
    elif not _HUB_ID.match(model):
        raise ConfigError(f"{model!r} is neither a local directory nor a hub id ('name' or 'org/name')")
    return model


def _looks_like_a_path(text: str) -> bool:
    return (
        text.startswith(("/", "./", "../", "~", "."))
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or text.endswith(".json")
    )


def read_config_file(file: Path) -> dict:
    """A config.json's fields, as far as they can be checked without transformers: JSON, an
    object, a model_type."""
    if not file.is_file():
        raise ConfigError(f"{file.parent} has no config.json (the tools read a model's config.json, never its weights)")
    try:
        fields = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file} is not valid JSON: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {file}: {error}") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{file} holds a JSON {type(fields).__name__}, not an object of a config's fields")
    model_type = fields.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f"{file} has no field 'model_type' (such as \"llama\"), from which transformers knows the model to build"
        )
    return fields


def load_config(model: str | Path, *, trust_remote_code: bool = False):
    """The config of a local model directory (its config.json; never weights) or a hub id (only
    its config.json is fetched). Code from the hub runs only with `trust_remote_code=True`."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    local = path.is_dir() or path.is_file()  # a directory, or its config.json
    where = f"{path / 'config.json'}" if path.is_dir() else str(path) if local else f"the hub id {str(model)!r}"
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json")
    reachable = local or _hub_reachable()
    try:
        config = AutoConfig.from_pretrained(
            str(path) if local else str(model), local_files_only=not reachable, trust_remote_code=trust_remote_code
        )
    except ValueError as error:
        text = str(error)
        if "trust_remote_code" in text:
            raise ConfigError(
                f"{where} needs code from the hub (its auto_map); pass --trust-remote-code to run it"
            ) from None
        raise ConfigError(f"cannot read {where}: {text.splitlines()[0]}") from None
    except OSError as error:
        if not reachable:
            raise ConfigError(
                f"cannot read {where}: the hub cannot be reached from here (offline) and its config.json is not in the "
                "Hugging Face cache; put the model's config.json in a directory and give that directory"
            ) from None
        raise ConfigError(f"cannot read {where}: {str(error).splitlines()[0]}") from None
    text_config = config.get_text_config()
    for field in ("hidden_size", "num_hidden_layers", "vocab_size"):
        value = getattr(text_config, field, None)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    _check_causal_lm(config, where)
    return config


def _hub_reachable() -> bool:
    """Whether the hub's host name resolves: offline, huggingface_hub retries for about 25 s
    before it gives up; the cache is all there is then. False with HF_HUB_OFFLINE set."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    from hf_offload.internal import resolve

    endpoint = resolve("huggingface-hub.constants")
    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.getaddrinfo(urlparse(endpoint).hostname, 443)
    except OSError:
        return False
    return True


def _check_causal_lm(config, where: str) -> None:
    """What the tools simulate and measure is causal-LM training: a model type transformers has
    an AutoModelForCausalLM class for (or the config's own, from the hub), as a decoder."""
    from hf_offload.internal import resolve

    causal_lm_types = resolve("transformers.causal_lm_types")
    model_type = getattr(config, "model_type", None)
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if model_type not in causal_lm_types and not remote:
        raise ConfigError(
            f"{where}: model_type {model_type!r} has no causal-LM class in transformers (AutoModelForCausalLM), and "
            "the tools train causal LMs: decoder models such as llama, qwen2, mistral, gemma "
            f"({len(causal_lm_types)} types in all)"
        )
    if getattr(config, "is_decoder", True) is False:  # BERT and its kin: an encoder unless told otherwise
        raise ConfigError(
            f"{where}: a {model_type} encoder (is_decoder is false): its attention is bidirectional and it trains on "
            'masked tokens, not as a causal LM; set "is_decoder": true in config.json to train it as one'
        )
