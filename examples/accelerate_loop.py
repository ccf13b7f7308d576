"""Activation offloading in a custom accelerate loop, with gradient accumulation.

    python examples/accelerate_loop.py                    # tiny random Llama, no download
    python examples/accelerate_loop.py --model PATH       # a local model directory
    accelerate launch --num_processes 2 examples/accelerate_loop.py     # DDP on 2 GPUs
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --cpu   # 2 CPU processes

`--compare` runs the same loop again without offloading and says whether the losses and the
final weights are bit-identical. Without an accelerator the engine runs with
`simulate_on_cpu=True`, which exercises it fully but saves no memory.
"""

from __future__ import annotations

import argparse
import copy

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_offload  # noqa: F401  (adds enable_activation_offloading to every model)


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=max(64, args.seq_len),
    )
    return LlamaForCausalLM(config)


def train(accelerator: Accelerator, model: torch.nn.Module, args: argparse.Namespace, offload: bool):
    if offload:
        # Before prepare, on the model itself. (After prepare works too: enable it on
        # accelerator.unwrap_model(prepared).)
        if accelerator.device.type == "cpu":  # run the engine anyway; the tiny model's tensors are small
            model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
        else:
            model.enable_activation_offloading()
    model.train()
    micro_batches = args.steps * args.grad_accum * accelerator.num_processes
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(model.config.vocab_size, (micro_batches * args.batch_size, args.seq_len), generator=generator)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)  # split across processes by prepare
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, step_loss = [], 0.0
    for ids in loader:
        with accelerator.accumulate(prepared):
            loss = prepared(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)  # divides by gradient_accumulation_steps
            optimizer.step()  # a no-op until the last micro-batch of the step
            optimizer.zero_grad()
        losses.append(loss.detach())
        step_loss += loss.item() / args.grad_accum
        if accelerator.sync_gradients:
            label = "offloaded" if offload else "plain"
            accelerator.print(f"step {len(losses) // args.grad_accum - 1}: loss {step_loss:.4f} ({label})")
            step_loss = 0.0
    unwrapped = accelerator.unwrap_model(prepared)
    weights = {name: p.detach().clone() for name, p in unwrapped.named_parameters()}
    return losses, weights, unwrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even if an accelerator is present")
    parser.add_argument("--compare", action="store_true", help="run again without offloading and compare")
    args = parser.parse_args()

    cpu = args.cpu or not torch.accelerator.is_available()
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=args.grad_accum)
    accelerator.print(f"processes: {accelerator.num_processes}, device: {accelerator.device.type}")
    model = load_model(args)
    reference = copy.deepcopy(model) if args.compare else None

    losses, weights, unwrapped = train(accelerator, model, args, offload=True)
    stats = unwrapped.activation_offloading_stats()
    accelerator.print(stats.summary())
    if reference is not None:
        plain_losses, plain_weights, _ = train(accelerator, reference, args, offload=False)
        same_losses = all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
        same_weights = all(torch.equal(plain_weights[name], weights[name]) for name in plain_weights)
        flags = torch.tensor([same_losses, same_weights], dtype=torch.int64, device=accelerator.device)
        flags = accelerator.reduce(flags, reduction="sum")  # every process must agree
        yes = lambda flag: "yes" if int(flag) == accelerator.num_processes else "no"  # noqa: E731
        accelerator.print(f"bit-identical: losses {yes(flags[0])}, final weights {yes(flags[1])}")


if __name__ == "__main__":
    main()
