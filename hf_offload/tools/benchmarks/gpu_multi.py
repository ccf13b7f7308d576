"""Sequence parallelism across the GPUs of one machine, measured: prepared, not yet run on GPUs.

    torchrun --nproc-per-node N -m hf_offload.tools.benchmarks.gpu_multi \\
        [--preset llama-3-8b] [--lengths 131072 262144] [--modes ...] [--steps 3] [--out FILE]

ALST's full fine-tuning recipe on our stack, on every rank: DeepSpeed ZeRO-3 with the parameters
and the optimizer state offloaded to the host, bf16, non-reentrant checkpointing, DeepSpeed's
Ulysses splitting each sequence across all N ranks (hf_offload.integrations.sequence_parallel),
batch 1. The modes add hf_offload on top:

- `sp`: the above alone (checkpoint inputs stay on the device);
- `sp+hf_offload`: the checkpoint inputs offloaded to the host (our checkpoint offload);
- `sp+hf_offload+tiled`: and sequence tiling (MLPs, norms, projections and the loss head a
  slice at a time).

For each length (ascending) and mode: the peak device memory of the step (the largest over the
ranks), the step time (the median over the steps after the first, every rank synchronised) and
tokens per second. Rank 0 prints the table and rewrites --out (JSON) after every measurement, so a
run that ends early (an out-of-memory error on one rank ends every rank: the others wait in the
all-to-all) keeps what it measured. The simulator does not model sequence parallelism yet (issue
26, item 4): the simulated column says so until `hf-offload estimate` can give one rank's peak.

`--cpu-smoke` runs the same code on the CPU (gloo, DS_ACCELERATOR=cpu, a two-layer tiny model,
offloading simulated, 16-token slices): it checks this script, not a GPU; no peak is measured
there. tests/test_sequence_parallel.py runs it inside its torchrun launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODES = ("sp", "sp+hf_offload", "sp+hf_offload+tiled")
SIMULATED = "not modelled yet (hf-offload estimate has no --sp: issue 26, item 4)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3-8b", help="a shape from hf_offload.tools.presets")
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144], help="tokens per sequence")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=3, help="steps per length and mode (the first is warm-up)")
    parser.add_argument("--out", default="gpu_multi.json")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is warm-up), got {args.steps}")
    return args


def ds_config(cpu_smoke: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": not cpu_smoke},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": not cpu_smoke},
            "offload_optimizer": {"device": "cpu", "pin_memory": not cpu_smoke},
        },
        # torch's AdamW on the host partitions: DeepSpeed's CPU Adam would compile an extension first.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }


def build(args: argparse.Namespace, mode: str, config: dict):
    import deepspeed
    from transformers import AutoModelForCausalLM

    import hf_offload
    from hf_offload.tools.presets import preset_config

    model_config = preset_config("tiny" if args.cpu_smoke else args.preset)
    if args.cpu_smoke:
        model_config.num_hidden_layers = 2
    model_config.use_cache = False
    model_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(
            model_config, dtype=torch.float32 if args.cpu_smoke else torch.bfloat16, attn_implementation="sdpa"
        )
    model.train()
    model.activation_checkpointing_enable()
    smoke = {"simulate_on_cpu": True, "min_offload_bytes": 0} if args.cpu_smoke else {}
    if "hf_offload" in mode:
        hf_offload.enable_activation_offloading(model, **smoke)
    if "tiled" in mode:  # on the CPU, slices small enough for the smoke's lengths
        hf_offload.enable_sequence_tiling(model, tile_tokens=16 if args.cpu_smoke else None)
    return model


def measure(args: argparse.Namespace, mode: str, length: int, device: torch.device) -> dict:
    import deepspeed

    from hf_offload.integrations import sequence_parallel as sp

    config = ds_config(args.cpu_smoke)
    model = build(args, mode, config)
    world = dist.get_world_size()
    ulysses = sp.register_ulysses(model, world, micro_batch_size=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=ulysses.mpu)
    # Every rank a batch of its own, as Ulysses expects (adapt refuses ranks holding the same ones).
    generator = torch.Generator().manual_seed(length * world + dist.get_rank())
    ids = torch.randint(model.config.vocab_size, (1, length), generator=generator)
    batches = [{"input_ids": ids, "labels": ids}] * -(-args.steps // world)
    times, peaks, losses = [], [], []
    for step, batch in enumerate(ulysses.adapt(batches)):
        if step == args.steps:
            break
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        started = time.perf_counter()
        loss = ulysses.loss(engine, batch)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        dist.barrier()
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    engine.destroy()
    sp.unregister_ulysses()
    stats = hf_offload_stats(model, mode)
    peak = torch.tensor([max(peaks) if peaks else -1], dtype=torch.int64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step = statistics.median(times[1:])
    return {
        "mode": mode,
        "length": length,
        "tokens_per_rank": length // world,
        "sp": world,
        "status": "ok",
        "peak_bytes": int(peak) if int(peak) >= 0 else None,
        "step_seconds": step,
        "tokens_per_second": length / step,
        "losses": losses,
        "offloaded_bytes": stats,
        "simulated_peak_bytes": None,
        "simulated": SIMULATED,
    }


def hf_offload_stats(model, mode: str) -> int | None:
    if "hf_offload" not in mode:
        return None
    import hf_offload

    return hf_offload.activation_offloading_stats(model).offloaded_bytes


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | tokens | per rank | peak GiB (max rank) | simulated GiB | step s | tokens/s | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peak = f"{row['peak_bytes'] / 2**30:.2f}" if row.get("peak_bytes") else "-"
        step = f"{row['step_seconds']:.3f}" if row.get("step_seconds") else "-"
        rate = f"{row['tokens_per_second']:.0f}" if row.get("tokens_per_second") else "-"
        lines.append(
            f"| {row['mode']} | {row['length']} | {row['tokens_per_rank']} | {peak} | - | {step} | {rate} | "
            f"{row['status']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo" if args.cpu_smoke or not torch.cuda.is_available() else "nccl")
    if not args.cpu_smoke and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    rank = dist.get_rank()
    rows: list[dict] = []
    for length in sorted(args.lengths):
        if length % dist.get_world_size():
            raise SystemExit(f"--lengths: {length} is not a multiple of the {dist.get_world_size()} ranks")
        for mode in args.modes:
            rows.append(measure(args, mode, length, device))
            if rank == 0:
                Path(args.out).write_text(json.dumps({"sp": dist.get_world_size(), "rows": rows}, indent=1))
    if rank == 0:
        print(f"sequence parallelism over {dist.get_world_size()} ranks ({device.type}); simulated: {SIMULATED}")
        print(table(rows))
    if started_here:
        dist.barrier()
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
