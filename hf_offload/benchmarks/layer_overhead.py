"""The CPU time hf_offload adds to each decoder layer call, the cost that stalls short sequences.

    python -m hf_offload.benchmarks.layer_overhead [--layers 16] [--steps 30]

On a GPU the forward pass is issued by the CPU ahead of the kernels; when issuing a layer takes
longer than running it, the GPU waits. Checkpointing alone already keeps a 1B model at 4k tokens
close to that point (measured on an H200: 25.1 ms to issue the forward against 31.1 ms of GPU
time), so every microsecond the offload wrapper and engine add per layer call shows up as step
time. This benchmark measures that CPU cost without a GPU: a Llama with tiny layers, so that
the layer's own work is mostly Python and dispatch as on a GPU host, runs forward and backward
with and without offloading (alternately, on twin models), on both paths:

- `checkpointing`: non-reentrant activation checkpointing, one saved tensor per layer;
- `full`: no checkpointing, every saved tensor offloaded (min_offload_bytes=0, ~16 per layer).

The engine runs its accelerator code path (`AcceleratorStreams`) against stand-in streams and
events that do nothing (`hf_offload.benchmarks.standin`), so what is timed is the engine's own
Python, not a driver's. It prints, per layer call, the forward and backward CPU time without and
with offloading, the difference, and their ratio; all measured in the same run, medians of
`--steps` alternating pairs after warm-up, median of `--repeats` such measurements.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_offload
from hf_offload.bench import set_checkpointing
from hf_offload.benchmarks.standin import stand_in_accelerator

CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def _step(model, ids) -> tuple[float, float]:
    """CPU seconds of this thread in one forward and in its backward. CPU time of the thread,
    not wall time: what the host spends issuing the work, and far less disturbed than wall
    time by other processes on a shared machine."""
    start = time.thread_time()
    loss = model(input_ids=ids, labels=ids).loss
    middle = time.thread_time()
    loss.backward()
    end = time.thread_time()
    model.zero_grad(set_to_none=True)
    return middle - start, end - middle


def measure(path: str, *, layers: int, seq_len: int, steps: int, lora_rank: int | None) -> dict[str, float]:
    """Per layer call: median forward and backward CPU time without and with offloading, from
    `steps` pairs of steps run alternately (so that a slow spell of the machine hits both)."""
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **CONFIG)).train()
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        plain = get_peft_model(plain, LoraConfig(r=lora_rank, target_modules="all-linear")).get_base_model()
    if path == "checkpointing":
        set_checkpointing(plain, True)
    offloaded = copy.deepcopy(plain)
    ids = torch.randint(CONFIG["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0))
    samples = {key: [] for key in ("forward_plain", "forward_offloaded", "backward_plain", "backward_offloaded")}
    with stand_in_accelerator():
        hf_offload.enable_activation_offloading(offloaded, min_offload_bytes=0, simulate_on_cpu=True)
        for index in range(steps + 2):
            gc.collect()
            forward_plain, backward_plain = _step(plain, ids)
            forward_offloaded, backward_offloaded = _step(offloaded, ids)
            if index >= 2:  # warm-up: first calls, the host pool's first buffers
                samples["forward_plain"].append(forward_plain)
                samples["forward_offloaded"].append(forward_offloaded)
                samples["backward_plain"].append(backward_plain)
                samples["backward_offloaded"].append(backward_offloaded)
        stats = offloaded.activation_offloading_stats()
    result = {key: statistics.median(values) / layers for key, values in samples.items()}
    result["tensors_per_layer"] = stats.offloaded_tensors / max(stats.layers_offloaded, 1)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="pairs of steps (plain, offloaded) per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="whole measurements; the median is shown")
    parser.add_argument("--lora-rank", type=int, default=8, help="rank of the LoRA rows (0: no LoRA rows)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; Llama with {args.layers} tiny layers, {args.seq_len} tokens; per layer call, us")
    print("| path | tensors offloaded per layer | forward plain | forward offloaded | added | ratio "
          "| backward plain | backward offloaded | added | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path, lora_rank in [(p, r) for r in (None, args.lora_rank or None) for p in ("checkpointing", "full")][
        : 4 if args.lora_rank else 2
    ]:
        runs = [
            measure(path, layers=args.layers, seq_len=args.seq_len, steps=args.steps, lora_rank=lora_rank)
            for _ in range(args.repeats)
        ]
        row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        cells = [path + (f" + LoRA r={lora_rank}" if lora_rank else ""), f"{row['tensors_per_layer']:.0f}"]
        for phase in ("forward", "backward"):
            plain, offloaded = row[f"{phase}_plain"], row[f"{phase}_offloaded"]
            cells += [f"{plain * 1e6:.0f}", f"{offloaded * 1e6:.0f}", f"{(offloaded - plain) * 1e6:.0f}",
                      f"{offloaded / plain:.2f}x"]  # fmt: skip
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
