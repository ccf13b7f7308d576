"""Supervised fine-tuning with TRL's SFTTrainer and hf_offload's activation offloading.

    python examples/trl_sft.py                   # tiny random Llama and a word-level tokenizer, no download
    python examples/trl_sft.py --model PATH      # a local model directory with its tokenizer (never downloads)
    python examples/trl_sft.py --lora            # LoRA through SFTTrainer(peft_config=...)
    python examples/trl_sft.py --compare         # also train without offloading and compare
    python examples/trl_sft.py --control         # --compare, plus a second run without offloading

Offloading is enabled on the model before it is handed to SFTTrainer. Leave TRL's own
`activation_offloading` off (its default): both would offload, TRL's only what hf_offload leaves.
SFTConfig turns gradient checkpointing on by default, which hf_offload combines with offloading
(only the checkpointed layers' inputs move); `--no-checkpointing` turns it off. On a machine
without an accelerator the run uses `simulate_on_cpu=True`, which runs the real engine but saves
no memory.

`--compare` needs kernels that repeat bit for bit. On the CPU they do; on an accelerator both runs
use eager attention, `torch.use_deterministic_algorithms(True, warn_only=True)` and (CUDA)
`CUBLAS_WORKSPACE_CONFIG=:4096:8`. If an op without a deterministic implementation runs anyway, a
difference gets "cannot tell", not "NO". Exit status: 0 identical (or no --compare), 1 different,
3 cannot tell.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import hf_offload  # noqa: F401  (adds enable_activation_offloading to every model)
from hf_offload.tools.determinism import DeterministicKernels, train_and_compare

WORDS = (  # noqa: SIM905
    "the a one cat dog bird fox sat ran flew jumped slept on under over near "
    "mat log tree hill red blue green big small old young quickly slowly quietly and then"
).split()


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a fixed vocabulary: no download, no training."""
    vocab = {token: index for index, token in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def sentences(count: int, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(count):
        length = int(torch.randint(8, 24, (1,), generator=generator))
        result.append(" ".join(WORDS[i] for i in torch.randint(len(WORDS), (length,), generator=generator)))
    return result


def load(path: str | None, on_accelerator: bool):
    if path:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        dtype = torch.bfloat16 if on_accelerator else torch.float32
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype), tokenizer
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config), tokenizer


def train(args: argparse.Namespace, offload: bool, kernels: DeterministicKernels | None = None):
    on_accelerator = torch.accelerator.current_accelerator() is not None
    model, tokenizer = load(args.model, on_accelerator)
    if kernels is not None:
        kernels.prepare(model)  # eager attention on an accelerator; nothing on the CPU
    if offload:
        # Under CPU simulation nothing is saved anyway: let tensors of every size through, so that
        # the tiny model shows the engine at work.
        options = {} if on_accelerator else {"simulate_on_cpu": True, "min_offload_bytes": 0}
        model.enable_activation_offloading(**options)
    with tempfile.TemporaryDirectory() as output_dir:
        config = SFTConfig(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            use_cpu=not on_accelerator,
            bf16=on_accelerator and args.model is not None,
            max_length=args.max_length,
            activation_checkpointing=not args.no_checkpointing,
            activation_offloading=False,  # TRL's own offloading: hf_offload does it
            disable_tqdm=True,
        )
        dataset = Dataset.from_dict({"text": sentences(args.steps * args.batch_size)})
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if args.lora else None
        torch.manual_seed(0)  # the same LoRA initialisation in both runs of --compare
        trainer = SFTTrainer(
            model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, trainer.model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter on all linear layers")
    parser.add_argument("--no-checkpointing", action="store_true", help="SFTConfig(activation_checkpointing=False)")
    parser.add_argument("--compare", action="store_true", help="also train without offloading and compare")
    parser.add_argument(
        "--control",
        action="store_true",
        help="--compare, and train twice without offloading: proves the kernels repeat",
    )
    args = parser.parse_args()
    exit_code, model = train_and_compare(
        lambda offload, kernels: train(args, offload=offload, kernels=kernels),
        compare=args.compare,
        control=args.control,
    )
    print(model.activation_offloading_stats().summary())
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
