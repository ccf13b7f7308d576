"""What ends a GRPO generation before memory does: the model's positions (with its rope scaling)
and, with vLLM, its `max_model_len`; and which vLLM releases an answer assumes.

The model's positions. A rotary model has no table to index past, but it was trained on
`max_position_embeddings` positions (or, rope-scaled, on the length its scaling stretches them to):
past them its output is not what it was trained for. vLLM derives its limit the same way
(`ModelConfig`'s `_get_and_verify_max_len`, cited, vLLM not installed here): the config's
`max_position_embeddings` (or `n_positions` ...), and with `rope_scaling` of a type other than
"su", "longrope" and "llama3", times its `factor`, from `original_max_position_embeddings` for
"yarn". (Llama-3.1's "llama3" scaling is already in its 131,072.)

TRL 1.16 passes `vllm_max_model_length` as `LLM(max_model_len=...)` (trl/generation/
vllm_generation.py, `VLLMGeneration._init_vllm`); left None, vLLM takes the derived length. A
larger one vLLM refuses unless `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` is set ("positions exceeding
derived_max_model_len lead to nan" for RoPE models); at start it checks that one sequence of
`max_model_len` tokens fits its KV cache, and refuses to start where it does not. A row stops at
`max_model_len` (finish reason "length"). transformers' `generate`, TRL's default, stops only at
`max_new_tokens` (TRL's `max_completion_length`): it runs past the positions without a word.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

# The keys vLLM reads for a model's length (the smallest present wins), in its order.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")  # fmt: skip
# Rope types whose factor vLLM does not apply (their length is already the config's).
_UNSCALED = ("su", "longrope", "llama3", "default")
# What `--rope-scaling` accepts: the types whose factor stretches the positions.
ROPE_TYPES = ("yarn", "linear", "dynamic")
# TRL 1.16's accepted vLLM releases (trl/import_utils.py, is_vllm_available: it warns outside them).
TRL_VLLM_RANGE = ("0.22.0", "0.31.0")
DEFAULT_VLLM_VERSION = TRL_VLLM_RANGE[1]  # the newest TRL 1.16 accepts
# vLLM releases that answer `quantization="bitsandbytes"` with "Unknown quantization method":
# bitsandbytes left vLLM's built-in quantizations (seen in 0.31 and 0.34, issue 44). The last
# release that still loads it is not established here: 0.22-0.30 are assumed to.
VLLM_WITHOUT_BITSANDBYTES = "0.31.0"


@dataclass(frozen=True)
class Positions:
    """The positions a model was trained on, and how they were read."""

    tokens: int
    source: str  # e.g. "max_position_embeddings 40,960" or "original_max_position_embeddings 32,768 x yarn 4"


def parse_rope_scaling(text: str) -> dict:
    """`TYPE:FACTOR[:ORIGINAL]` (e.g. `yarn:4:32768`, as Qwen documents for Qwen3) as a rope
    scaling dict; a clear error naming the bad part otherwise."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ROPE_TYPES:
        raise ValueError(f"{text!r}: give TYPE:FACTOR[:ORIGINAL_POSITIONS] with TYPE one of {', '.join(ROPE_TYPES)} "
                         "(e.g. yarn:4:32768)")  # fmt: skip
    try:
        factor = float(parts[1])
    except ValueError:
        raise ValueError(f"{text!r}: the factor {parts[1]!r} is not a number") from None
    if not factor > 1:
        raise ValueError(f"{text!r}: the factor must be above 1 (it stretches the positions), got {parts[1]}")
    scaling = {"rope_type": parts[0], "factor": factor}
    if len(parts) == 3:
        if not re.fullmatch(r"[1-9][0-9]*", parts[2]):
            raise ValueError(f"{text!r}: the original positions {parts[2]!r} are not a positive whole number")
        scaling["original_max_position_embeddings"] = int(parts[2])
    return scaling


def with_rope_scaling(config, scaling: dict):
    """A copy of `config` whose text model's RoPE is scaled by `scaling` (`parse_rope_scaling`),
    as a user edits config.json (transformers 5 reads it as `rope_parameters`). A model without
    RoPE parameters is refused."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    current = getattr(text, "rope_parameters", None)
    if not isinstance(current, dict):
        raise ValueError(f"--rope-scaling: {type(text).__name__} has no rope parameters to scale")
    scaled = dict(current, **scaling)
    if scaled["rope_type"] == "yarn" and "original_max_position_embeddings" not in scaling:
        scaled["original_max_position_embeddings"] = current.get("original_max_position_embeddings",
                                                                 text.max_position_embeddings)  # fmt: skip
    text.rope_parameters = scaled
    return config


def _rope(text) -> dict | None:
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    return rope if isinstance(rope, dict) else None


def model_positions(config) -> Positions | None:
    """The model's positions as vLLM derives them (module docstring); None where the config names
    none."""
    text = config.get_text_config()
    found = [(key, getattr(text, key)) for key in _LENGTH_KEYS if isinstance(getattr(text, key, None), int)]
    if not found:
        return None
    key, tokens = min(found, key=lambda item: item[1])
    source = f"{key} {tokens:,}"
    rope = _rope(text)
    kind = None if rope is None else rope.get("rope_type", rope.get("type"))
    if rope is not None and kind not in _UNSCALED:
        factor = rope.get("factor", 1.0)
        if kind == "yarn" and rope.get("original_max_position_embeddings"):
            tokens = rope["original_max_position_embeddings"]
            source = f"original_max_position_embeddings {tokens:,}"
        tokens = int(tokens * factor)
        source = f"{source} x {kind} factor {factor:g} = {tokens:,}"
    return Positions(tokens, source)


def vllm_max_model_len(positions: Positions | None, given: int | None) -> tuple[int | None, str]:
    """vLLM's `max_model_len` under TRL 1.16 (`vllm_max_model_length`, None: derived), refused in
    vLLM's words where vLLM refuses it."""
    if given is None:
        if positions is None:
            return None, ""
        return positions.tokens, f"vLLM's max_model_len, derived from the model ({positions.source})"
    if positions is not None and given > positions.tokens:
        raise ValueError(
            f"--vllm-max-model-length {given:,}: vLLM refuses it: \"User-specified max_model_len ({given}) is greater "
            f"than the derived max_model_len ({positions.source})\"; it allows it only with "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, warning that a RoPE model's positions past the derived length lead to "
            f"NaN: give at most {positions.tokens:,}, or scale the positions (--rope-scaling)"
        )
    return given, f"vLLM's max_model_len (vllm_max_model_length {given:,})"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def check_vllm_version(text: str) -> str:
    """`--vllm-version`: a release TRL 1.16 accepts (its own range), as X.Y or X.Y.Z."""
    if not re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?", text):
        raise ValueError(f"{text!r} is not a vLLM release (give X.Y or X.Y.Z, e.g. {DEFAULT_VLLM_VERSION})")
    low, high = TRL_VLLM_RANGE
    version = _version(text if text.count(".") == 2 else text + ".0")
    if not _version(low) <= version <= _version(high):
        raise ValueError(f"{text}: TRL 1.16 supports vLLM versions from {low} to {high} (trl's is_vllm_available "
                         "warns outside them); the estimate models those")  # fmt: skip
    return text if text.count(".") == 2 else text + ".0"


def loads_bitsandbytes(version: str) -> bool:
    """Whether this vLLM release takes TRL's `quantization="bitsandbytes"` (`VLLM_WITHOUT_BITSANDBYTES`)."""
    return _version(version) < _version(VLLM_WITHOUT_BITSANDBYTES)


def refuse_four_bit_vllm(version: str) -> None:
    """A 4-bit policy with colocated vLLM on a release that cannot load bitsandbytes: refused in
    TRL's and vLLM's words, before anything is simulated."""
    if loads_bitsandbytes(version):
        return
    low = TRL_VLLM_RANGE[0]
    raise ValueError(
        f"a 4-bit policy with colocated vLLM {version} does not start: TRL finds bitsandbytes' Linear4bit in the "
        "policy and builds LLM(..., quantization=\"bitsandbytes\") (trl/generation/vllm_generation.py), and vLLM "
        f"{version} answers \"Unknown quantization method: bitsandbytes\" (it left vLLM's built-in quantizations; "
        f"seen from {VLLM_WITHOUT_BITSANDBYTES}): give --vllm-version from {low} to the last release before "
        f"{VLLM_WITHOUT_BITSANDBYTES}, train without --load-in-4bit, or use --vllm-mode server with a 16-bit model"
    )


def vllm_range(version: str, four_bit) -> str:
    """The vLLM releases an answer for `version` assumes (`four_bit`: the policy's 4-bit setup, or None)."""
    low, high = TRL_VLLM_RANGE
    if four_bit:
        return (f"vLLM {low} up to before {VLLM_WITHOUT_BITSANDBYTES} (TRL 1.16 accepts {low}-{high}; a 4-bit policy "
                f"needs vLLM's bitsandbytes loader, gone from {VLLM_WITHOUT_BITSANDBYTES}), --vllm-version {version}")
    return f"vLLM {low}-{high} (TRL 1.16's range), --vllm-version {version}"


def check_generation(config, training) -> None:
    """What vLLM would refuse at start under TRL 1.16, refused before anything is simulated."""
    trl = training.trl
    if trl is None or trl.trainer != "grpo" or not trl.generation.use_vllm:
        return
    how = trl.generation
    if how.colocated and training.four_bit is not None:
        refuse_four_bit_vllm(how.vllm_version)
    tokens, _ = vllm_max_model_len(model_positions(config), how.vllm_max_model_length)
    if tokens is not None and tokens <= trl.prompt_length:
        raise ValueError(f"vLLM's max_model_len {tokens:,} leaves no completion after a {trl.prompt_length:,}-token "
                         "prompt (vLLM refuses prompts as long as its max_model_len)")  # fmt: skip
