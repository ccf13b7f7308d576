"""Activation offloading in a custom accelerate loop, with gradient accumulation.

    python examples/accelerate_loop.py                    # tiny random Llama, no download
    python examples/accelerate_loop.py --model PATH       # a local model directory
    accelerate launch --num_processes 2 examples/accelerate_loop.py     # DDP on 2 GPUs
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --cpu   # 2 CPU processes

`--compare` runs the same loop again without offloading and says whether the losses and the
final weights are bit-identical; `--control` also runs it a second time without offloading, to
prove that the kernels repeat. Bit-identical results need kernels that repeat bit for bit: on the
CPU they do; on an accelerator both runs use eager attention,
`torch.use_deterministic_algorithms(True, warn_only=True)` and (CUDA) `CUBLAS_WORKSPACE_CONFIG=:4096:8`.
If an op without a deterministic implementation runs anyway (on any process), a difference gets
"cannot tell", not "NO". Exit status: 0 identical (or no --compare), 1 different, 3 cannot tell.
Without an accelerator the engine runs with `simulate_on_cpu=True`, which exercises it fully but
saves no memory.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_offload  # noqa: F401  (adds enable_activation_offloading to every model)
from hf_offload.tools.determinism import DeterministicKernels, losses_and_weights_verdict, same_tensors


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even if an accelerator is present")
    parser.add_argument("--compare", action="store_true", help="run again without offloading and compare")
    parser.add_argument(
        "--control", action="store_true", help="--compare, and run twice without offloading: proves the kernels repeat"
    )
    args = parser.parse_args()
    compare = args.compare or args.control

    cpu = args.cpu or not torch.accelerator.is_available()
    # Before any CUDA work (the Accelerator starts it): PyTorch reads CUBLAS_WORKSPACE_CONFIG at its
    # first cuBLAS call.
    kernels = DeterministicKernels("cpu" if cpu else None) if compare else None
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=args.grad_accum)
    try:
        return run(accelerator, args, kernels)
    finally:
        # Tear down together, after the prepared models (DDP's reducer holds the process group and
        # its pending work) are gone: otherwise a process sometimes aborts at exit ("terminate
        # called without an active exception").
        accelerator.free_memory()
        gc.collect()
        accelerator.wait_for_everyone()
        accelerator.end_training()


def run(accelerator: Accelerator, args: argparse.Namespace, kernels: DeterministicKernels | None) -> int:
    """Train with offloading and, with --compare, without it; the exit status (the verdict's)."""
    compare = kernels is not None
    accelerator.print(f"processes: {accelerator.num_processes}, device: {accelerator.device.type}")
    model = load_model(args)
    if kernels is not None:
        kernels.prepare(model)  # eager attention on an accelerator; nothing on the CPU
        accelerator.print(kernels.describe())
    references = [copy.deepcopy(model) for _ in range(1 + args.control if compare else 0)]

    with kernels or contextlib.nullcontext():
        losses, weights, unwrapped = train(accelerator, model, args, offload=True)
        stats = unwrapped.activation_offloading_stats()
        accelerator.print(stats.summary())
        if not compare:
            return 0
        plain_losses, plain_weights, _ = train(accelerator, references[0], args, offload=False)
        if args.control:
            again_losses, again_weights, _ = train(accelerator, references[1], args, offload=False)
    control_identical = None
    if args.control:
        control_identical = same_tensors(plain_losses, again_losses) and same_tensors(
            plain_weights.values(), again_weights.values()
        )
        kernels.note_control(control_identical)
    flags = [
        same_tensors(plain_losses, losses),
        same_tensors(plain_weights.values(), (weights[name] for name in plain_weights)),
        not kernels.reasons,  # this process's kernels repeat (its control included)
        control_identical is not False,
    ]
    # Every process must agree: its own runs identical, its own kernels deterministic.
    counts = accelerator.reduce(torch.tensor(flags, dtype=torch.int64, device=accelerator.device), reduction="sum")
    same_losses, same_weights, deterministic, control_everywhere = (
        int(count) == accelerator.num_processes for count in counts
    )
    reasons = kernels.reasons or (() if deterministic else ("kernels not deterministic on another process",))
    if args.control:
        accelerator.print(f"control, two runs without offloading: {'identical' if control_everywhere else 'DIFFER'}")
    verdict, line = losses_and_weights_verdict(same_losses, same_weights, reasons)
    accelerator.print(line)
    return verdict.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
