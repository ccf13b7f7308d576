"""Measure, on the CPU, what the two QLoRA recipes of docs/peft.md cost: parameter bytes and one
training step's peak allocation.

    python -m hf_offload.tools.benchmarks.qlora_recipes [--seq-len 2048] [--tile-tokens 256]

A small Llama (8B's proportions scaled down, its own vocabulary) is saved with random weights
and loaded as users load a base, `from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.bfloat16), dtype=torch.bfloat16)`, then prepared either way:

- `prepare`: `peft.prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs=
  {"use_reentrant": False})`, which casts every parameter that is not 4-bit (norms, embeddings,
  lm_head) to float32;
- `bf16`: `model.activation_checkpointing_enable()` alone: those parameters stay bf16.

Both then get LoRA r=32 on every linear layer (PEFT's float32 adapters). The step's peak is what
the CPU allocator held at most during a forward and backward beyond the parameters and the
adapters' gradients (made by a first step), counted from torch's profiler
(`hf_offload.tools.allocations`): the dequantized 4-bit weights bitsandbytes makes in forward and
backward, the activations, the loss head's logits. Then again with sequence tiling, where the
logits exist a slice at a time and the checkpointed layers' inputs (the residual stream) and the
recomputed layer are what remain. No offloading: on the CPU its host copies would be counted too.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile

import torch

from hf_offload.tools.allocations import peak_allocated

RECIPES = ("prepare", "bf16")
SHAPES = dict(
    hidden_size=512,
    intermediate_size=1792,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def save_small_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPES)).to(torch.bfloat16).save_pretrained(path)


def load_recipe(path: str, recipe: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
    )
    if recipe == "prepare":
        model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_enable()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=32, target_modules="all-linear")).train()


def parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes by kind: the packed 4-bit weights with their quantization statistics, the other base
    parameters (norms, embeddings, lm_head) and the adapters. Each storage once."""
    from bitsandbytes.nn import Params4bit

    seen: set[int] = set()
    kinds = {"4-bit weights and statistics": 0, "norms, embeddings, lm_head": 0, "adapters": 0}

    def count(kind: str, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kinds[kind] += storage.nbytes()

    for parameter in model.parameters():
        if isinstance(parameter, Params4bit):
            state = parameter.quant_state
            nested = (state.offset, state.state2.absmax, state.state2.code) if state.nested else ()
            for tensor in (parameter, state.absmax, state.code, *nested):
                count("4-bit weights and statistics", tensor)
        else:
            count("adapters" if parameter.requires_grad else "norms, embeddings, lm_head", parameter)
    return kinds


def step_peak(model: torch.nn.Module, seq_len: int) -> int:
    ids = torch.randint(0, SHAPES["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(2))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # the first step allocates the adapters' gradients and whatever is made once
    peak, _ = peak_allocated(step)
    model.zero_grad(set_to_none=True)
    return peak


def step_peaks(model: torch.nn.Module, seq_len: int, tile_tokens: int) -> tuple[int, int]:
    """The step's peak with checkpointing, then with sequence tiling on top (`tile_tokens` slices,
    the loss head's included)."""
    import hf_offload

    plain = step_peak(model, seq_len)
    hf_offload.enable_sequence_tiling(model, tile_tokens=tile_tokens)
    return plain, step_peak(model, seq_len)


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tile-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    import bitsandbytes
    import peft
    import transformers

    rows = {}
    with tempfile.TemporaryDirectory() as path:
        save_small_llama(path)
        for recipe in RECIPES:
            model = load_recipe(path, recipe)
            rows[recipe] = parameter_bytes(model), step_peaks(model, args.seq_len, args.tile_tokens)
            del model
    kinds = list(rows[RECIPES[0]][0])
    print(
        f"Measured on the CPU {datetime.date.today()}: torch {torch.__version__}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}; "
        f"Llama {SHAPES}, LoRA r=32 on every linear layer, batch 1 x {args.seq_len} tokens, "
        f"non-reentrant checkpointing; tiled: {args.tile_tokens}-token slices.\n"
    )
    print(
        "| recipe | "
        + " | ".join(f"{kind}, MiB" for kind in kinds)
        + " | parameters, MiB | step's peak, MiB | step's peak tiled, MiB |"
    )
    print("|---" * (len(kinds) + 4) + "|")
    for recipe, (kinds_bytes, peaks) in rows.items():
        cells = " | ".join(mib(kinds_bytes[kind]) for kind in kinds)
        print(f"| {recipe} | {cells} | {mib(sum(kinds_bytes.values()))} | {' | '.join(map(mib, peaks))} |")


if __name__ == "__main__":
    main()
