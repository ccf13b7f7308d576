"""Long-run check: train a tiny model for many steps with and without offloading in lockstep.

    python -m hf_offload.tools.benchmarks.soak [--steps 1000]

Prints, every `--every` steps, the process RSS, the host pool size and the host memory held by
live handles, and at the end whether every loss and the final weights were bit-identical to
the run without offloading. Runs on the CPU with the engine simulating a device (on a machine
with CUDA it uses the GPU instead). Not part of the test suite; tests run a 100-step version.
"""

from __future__ import annotations

import argparse
import time

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_offload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, vocab_size=512
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).to(device).train()
    offloaded = LlamaForCausalLM(config).to(device).train()
    offloaded.load_state_dict(plain.state_dict())
    hf_offload.enable_activation_offloading(offloaded, simulate_on_cpu=device.type == "cpu", min_offload_bytes=0)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, offloaded)]
    generator = torch.Generator().manual_seed(0)
    process = psutil.Process()
    identical = True
    rss = []
    start = time.perf_counter()
    print(f"{'step':>6} {'rss MiB':>9} {'pool KiB':>9} {'held B':>7} {'loss':>10}")
    for step in range(1, args.steps + 1):
        ids = torch.randint(config.vocab_size, (2, args.seq_len), generator=generator).to(device)
        losses = []
        for model, optimizer in zip((plain, offloaded), optimizers, strict=True):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        identical &= torch.equal(*losses)
        rss.append(process.memory_info().rss)
        if step % args.every == 0 or step == 1:
            stats = offloaded.activation_offloading_stats()
            print(
                f"{step:>6} {rss[-1] / 2**20:>9.1f} {stats.pool_bytes / 1024:>9.1f} "
                f"{stats.host_bytes_held:>7} {losses[1].item():>10.6f}",
                flush=True,
            )
    weights_identical = all(torch.equal(p, q) for p, q in zip(plain.parameters(), offloaded.parameters(), strict=True))
    settled = rss[len(rss) // 10 :]
    print(f"steps: {args.steps} in {time.perf_counter() - start:.0f} s on {device}")
    print(f"RSS after the first 10% of steps: min {min(settled) / 2**20:.1f} MiB, max {max(settled) / 2**20:.1f} MiB")
    print(f"every loss bit-identical: {identical}; final weights bit-identical: {weights_identical}")
    return 0 if identical and weights_identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
