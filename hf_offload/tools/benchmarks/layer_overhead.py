"""The CPU time hf_offload adds to each decoder layer call, the cost that stalls short sequences.

    python -m hf_offload.tools.benchmarks.layer_overhead [--layers 16] [--steps 30]

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
events that do nothing (`hf_offload.tools.benchmarks.standin`), so what is timed is the engine's own
Python, not a driver's. A third twin runs each decoder layer under bare saved-tensor hooks that
keep every tensor (`pack` returns `tensor.data`, `unpack` returns it), without hf_offload: the
floor any offloader built on Python saved-tensor hooks pays before it does any work (autograd
calling into Python once per saved tensor, and the layer wrapper).

It prints, per layer call, the forward and backward CPU time without offloading, what the bare
hooks and what hf_offload add to it, and hf_offload's ratio to no offloading; all measured in
the same run, medians of `--steps` alternating rounds after warm-up, median of `--repeats`
such measurements.
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
from hf_offload.tools.benchmarks.standin import stand_in_accelerator
from hf_offload.tools.modes import set_checkpointing

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


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.data


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def with_bare_hooks(model) -> None:
    """Run each decoder layer of `model` under saved-tensor hooks that keep every tensor."""
    for layer in model.model.layers:
        forward = layer.forward

        def hooked(*args, _forward=forward, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(_keep, _same):
                return _forward(*args, **kwargs)

        layer.forward = hooked


def measure(path: str, *, layers: int, seq_len: int, steps: int, lora_rank: int | None) -> dict[str, float]:
    """Per layer call: median forward and backward CPU time without offloading, with bare hooks
    and with offloading, from `steps` rounds of steps run alternately (so that a slow spell of
    the machine hits all three)."""
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **CONFIG)).train()
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        plain = get_peft_model(plain, LoraConfig(r=lora_rank, target_modules="all-linear")).get_base_model()
    if path == "checkpointing":
        set_checkpointing(plain, True)
    offloaded, hooked = copy.deepcopy(plain), copy.deepcopy(plain)
    with_bare_hooks(hooked)
    ids = torch.randint(CONFIG["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0))
    variants = {"plain": plain, "hooks": hooked, "offloaded": offloaded}
    samples = {f"{phase}_{name}": [] for phase in ("forward", "backward") for name in variants}
    with stand_in_accelerator():
        hf_offload.enable_activation_offloading(offloaded, min_offload_bytes=0, simulate_on_cpu=True)
        for index in range(steps + 2):
            for name, model in variants.items():
                gc.collect()
                forward, backward = _step(model, ids)
                if index >= 2:  # warm-up: first calls, the host pool's first buffers
                    samples[f"forward_{name}"].append(forward)
                    samples[f"backward_{name}"].append(backward)
        stats = offloaded.activation_offloading_stats()
    result = {key: statistics.median(values) / layers for key, values in samples.items()}
    result["tensors_per_layer"] = stats.offloaded_tensors / max(stats.layers_offloaded, 1)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="rounds of steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="whole measurements; the median is shown")
    parser.add_argument("--lora-rank", type=int, default=8, help="rank of the LoRA rows (0: no LoRA rows)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; Llama with {args.layers} tiny layers, {args.seq_len} tokens; per layer call, us")
    print("| path | tensors offloaded per layer | forward plain | bare hooks add | hf_offload adds | ratio "
          "| backward plain | bare hooks add | hf_offload adds | ratio |")  # fmt: skip
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
            plain, hooks, offloaded = (row[f"{phase}_{name}"] for name in ("plain", "hooks", "offloaded"))
            cells += [f"{plain * 1e6:.0f}", f"{(hooks - plain) * 1e6:.0f}", f"{(offloaded - plain) * 1e6:.0f}",
                      f"{offloaded / plain:.2f}x"]  # fmt: skip
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
