"""Activation offloading with FSDP2 (`fully_shard`), launched by torchrun.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_torchrun.py                # tiny random Llama
    torchrun --standalone --nproc-per-node 8 examples/fsdp2_torchrun.py --model PATH   # a local model

One process per GPU (NCCL); without GPUs, CPU processes with gloo and the engine running with
`simulate_on_cpu=True`, which exercises it fully but saves no memory.

Order matters today: enable offloading *before* `fully_shard`. fully_shard swaps each decoder
layer's class for a generated subclass (FSDPLlamaDecoderLayer), which hf_offload's adapters do
not recognise yet (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_offload


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    torch.manual_seed(0)  # the same initial weights on every rank
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = load_model(args).to(device)
    model.train()
    if device.type == "cpu":  # run the engine anyway; the tiny model's tensors are small
        model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
    else:
        model.enable_activation_offloading()
    for layer in model.model.layers:  # one FSDP unit per decoder layer, then the root
        fully_shard(layer)
    fully_shard(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(args.steps):
        ids = torch.randint(model.config.vocab_size, (args.batch_size, args.seq_len), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        average = loss.detach().clone()
        dist.all_reduce(average)
        if rank == 0:
            stats = hf_offload.activation_offloading_stats(model)
            print(
                f"step {step}: loss {average.item() / dist.get_world_size():.4f}, "
                f"offloaded {stats.offloaded_tensors} tensors ({stats.offloaded_bytes / 2**20:.2f} MiB) per rank"
            )
    if rank == 0:
        print(hf_offload.activation_offloading_stats(model).summary())
    # Tear down together, after FSDP's state (which holds the process group and its pending
    # work) is gone: otherwise a rank sometimes aborts at exit ("terminate called without an
    # active exception") when the last of it is destroyed after the group.
    del model, optimizer, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
