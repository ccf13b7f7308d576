"""Activation offloading in a plain PyTorch training loop.

    python examples/own_loop.py                 # tiny random Llama, no download
    python examples/own_loop.py --model PATH    # a local model directory

On a machine without an accelerator the tiny model runs with `simulate_on_cpu=True`, which
runs the real engine but saves no memory.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_offload  # noqa: F401  (adds enable_activation_offloading to every model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    else:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, vocab_size=512
        )
        model = LlamaForCausalLM(config)
    model.to(device).train()
    model.enable_activation_offloading(simulate_on_cpu=device.type == "cpu")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids = torch.randint(model.config.vocab_size, (2, args.seq_len), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = model.activation_offloading_stats()
        print(f"step {step}: loss {loss.item():.4f}, offloaded {stats.offloaded_bytes / 2**20:.1f} MiB")
    print(model.activation_offloading_stats().summary())


if __name__ == "__main__":
    main()
