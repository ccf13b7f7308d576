"""Sequence parallelism across the GPUs of one machine, measured: prepared, not yet run on GPUs.

    torchrun --nproc-per-node N -m hf_offload.tools.benchmarks.gpu_multi \\
        [--preset llama-3-8b] [--lengths 131072 262144] [--modes ...] [--steps 3] [--out FILE]

ALST's full fine-tuning recipe on our stack, on every rank: DeepSpeed ZeRO-3 with the parameters
and the optimizer state offloaded to the host, bf16, non-reentrant checkpointing, DeepSpeed's
Ulysses splitting each sequence across all N ranks (hf_offload.integrations.sequence_parallel),
batch 1. The modes add hf_offload on top:

- `sp`: the above alone (checkpoint inputs stay on the device);
- `sp+hf_offload`: the checkpoint inputs offloaded to the host (our checkpoint offload);
- `sp+hf_offload+tiled+whole_heads`: and sequence tiling (MLPs, norms, projections and the loss
  head a slice at a time), with each rank's query heads through Ulysses's exchange at once
  (`tile_heads` = heads / N: DeepSpeed's own call);
- `sp+hf_offload+tiled`: the same with tiling's default, the rank's query heads a chunk at a
  time through the exchange (`hf_offload.tiling.ulysses_heads`, docs/sequence_parallel.md).

For each length (ascending) and mode: the peak device memory of the step (the largest over the
ranks), the step time (the median over the steps after the first, every rank synchronised),
tokens per second, and DeepSpeed's all-to-alls of a step, counted where they are called (forward
and the checkpoint's recompute; backward's mirror them): calls and bytes sent, which chunking
multiplies and keeps, respectively. Rank 0 prints the table and rewrites --out (JSON) after every
measurement, so a run that ends early (an out-of-memory error on one rank ends every rank: the
others wait in the all-to-all) keeps what it measured. The simulated column names the
`hf-offload estimate` command that simulates the same rank (run it beside, on any machine).

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

MODES = ("sp", "sp+hf_offload", "sp+hf_offload+tiled+whole_heads", "sp+hf_offload+tiled")
WHOLE_HEADS = "+whole_heads"


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


def simulated_command(args: argparse.Namespace, mode: str, length: int, world: int) -> str:
    """The `hf-offload estimate` command that simulates one rank of this measurement."""
    simulated = {"sp": "checkpointing", "sp+hf_offload": "checkpointing+hf_offload"}
    modes = simulated.get(mode, "checkpointing+hf_offload+tiled")
    heads = f" --tile-heads {preset_heads(args) // world}" if mode.endswith(WHOLE_HEADS) else ""
    preset = "tiny" if args.cpu_smoke else args.preset
    return (
        f"hf-offload estimate --preset {preset} --device <this GPU> --modes {modes} --offload-params "
        f"--sp {world} --seq-len {length}{heads}"
    )


def preset_heads(args: argparse.Namespace) -> int:
    from hf_offload.tools.presets import preset_config

    return preset_config("tiny" if args.cpu_smoke else args.preset).num_attention_heads


class CountedExchange:
    """DeepSpeed's all-to-all, counted where it is called (forward and a checkpoint's recompute;
    backward's exchanges are their gradients, through the op's own autograd, as many and as large)."""

    def __init__(self, world: int) -> None:
        self.world, self.original, self.block = world, None, None
        self.calls = self.sent_bytes = 0

    def __enter__(self):
        from hf_offload.integrations.upstream import replaced

        def counted(group, tensor):
            self.calls += 1
            self.sent_bytes += tensor.numel() * tensor.element_size() * (self.world - 1) // self.world
            return self.original(group, tensor)

        # DeepSpeed's private all-to-all, replaced through the upstream inventory: renamed, it stops here
        # with UpstreamChanged instead of counting nothing.
        self.block = replaced("deepspeed.all_to_all_counted", counted)
        self.original = self.block.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.block.__exit__(*exc)


def build(args: argparse.Namespace, mode: str, config: dict):
    import deepspeed
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    import hf_offload
    from hf_offload.tools.presets import preset_config

    model_config = preset_config("tiny" if args.cpu_smoke else args.preset)
    if args.cpu_smoke:
        model_config.num_hidden_layers = 2
    model_config.use_cache = False
    model_config._attn_implementation = "sdpa"
    # The model's class is imported before zero.Init: a class first created inside it loses the
    # __init__ that kernels' use_kernelized_func gives it (transformers >= 5.25) when zero.Init
    # exits, and the next model built in this process dies in its first forward on _kernel_funcs.
    MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
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
        # +whole_heads: a rank's query heads in one chunk, DeepSpeed's own exchange.
        heads = model_config.num_attention_heads // dist.get_world_size() if mode.endswith(WHOLE_HEADS) else None
        hf_offload.enable_sequence_tiling(model, tile_tokens=16 if args.cpu_smoke else None, tile_heads=heads)
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
    times, peaks, losses, exchanges = [], [], [], []
    for step, batch in enumerate(ulysses.adapt(batches)):
        if step == args.steps:
            break
        counted = CountedExchange(world)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        started = time.perf_counter()
        with counted:
            loss = ulysses.loss(engine, batch)
            engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        dist.barrier()
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
        exchanges.append((counted.calls, counted.sent_bytes))
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
        "all_to_alls": exchanges[-1][0],
        "all_to_all_sent_bytes": exchanges[-1][1],
        "simulated_peak_bytes": None,
        "simulated": simulated_command(args, mode, length, world),
    }


def hf_offload_stats(model, mode: str) -> int | None:
    if "hf_offload" not in mode:
        return None
    import hf_offload

    return hf_offload.activation_offloading_stats(model).offloaded_bytes


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | tokens | per rank | peak GiB (max rank) | simulated GiB | step s | tokens/s | all-to-alls "
        "| sent GiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peak = f"{row['peak_bytes'] / 2**30:.2f}" if row.get("peak_bytes") else "-"
        step = f"{row['step_seconds']:.3f}" if row.get("step_seconds") else "-"
        rate = f"{row['tokens_per_second']:.0f}" if row.get("tokens_per_second") else "-"
        sent = row["all_to_all_sent_bytes"] / 2**30
        lines.append(
            f"| {row['mode']} | {row['length']} | {row['tokens_per_rank']} | {peak} | - | {step} | {rate} | "
            f"{row['all_to_alls']} | {sent:.3f} | {row['status']} |"
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
        print(f"sequence parallelism over {dist.get_world_size()} ranks ({device.type}); simulated: each row's command")
        print(table(rows))
    if started_here:
        dist.barrier()
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
