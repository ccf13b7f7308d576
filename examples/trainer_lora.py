"""LoRA fine-tuning with transformers.Trainer and activation offloading.

    python examples/trainer_lora.py                  # tiny random Llama, no download
    python examples/trainer_lora.py --model PATH     # a local model directory (never downloads)
    python examples/trainer_lora.py --compare        # also train without offloading and compare
    python examples/trainer_lora.py --control        # --compare, plus a second run without offloading

Offloading is enabled on the model before `get_peft_model` (after works as well); Trainer needs
nothing else. On a machine without an accelerator the run uses `simulate_on_cpu=True`, which runs
the real engine but saves no memory (and lets tensors of every size through, so that the tiny
model shows the engine at work). The data are random token ids: the point is the memory, not
the model.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_offload  # noqa: F401  (adds enable_activation_offloading to every model)
from hf_offload.tools.determinism import DeterministicKernels, train_and_compare


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seq_len: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(vocab_size, (count, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def load_model(path: str | None, on_accelerator: bool) -> torch.nn.Module:
    if path:
        dtype = torch.bfloat16 if on_accelerator else torch.float32
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, vocab_size=512
    )
    return LlamaForCausalLM(config)


def train(
    args: argparse.Namespace, offload: bool, kernels: DeterministicKernels | None = None
) -> tuple[list[float], torch.nn.Module]:
    on_accelerator = torch.accelerator.current_accelerator() is not None
    model = load_model(args.model, on_accelerator)
    if kernels is not None:
        kernels.prepare(model)  # eager attention on an accelerator; nothing on the CPU
    if offload:
        options = {"simulate_on_cpu": not on_accelerator}
        if args.min_offload_bytes is not None:
            options["min_offload_bytes"] = args.min_offload_bytes
        elif not on_accelerator:
            options["min_offload_bytes"] = 0  # the simulation saves nothing anyway: let every tensor go through
        model.enable_activation_offloading(**options)
    torch.manual_seed(0)  # the same LoRA initialisation in both runs of --compare
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
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
            activation_checkpointing=args.checkpointing,
            disable_tqdm=True,
        )
        dataset = RandomTokens(args.steps * args.batch_size, args.seq_len, model.config.vocab_size)
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true", help="TrainingArguments(activation_checkpointing=True)")
    parser.add_argument(
        "--min-offload-bytes",
        type=int,
        help="saved tensors smaller than this stay on the device (default: 0 under CPU simulation, else the "
        "library default)",
    )
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
