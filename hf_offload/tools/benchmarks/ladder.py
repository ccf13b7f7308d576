"""What each piece of the longest-context recipe buys, simulated: the ladder.

    python -m hf_offload.tools.benchmarks.ladder [--out docs/img] [--jobs 2]

Llama-3-8B, LoRA r=16 on every linear layer (PEFT's fp32 adapters), bf16, batch 1, an AdamW step,
checkpointing + hf_offload + tiling, on the simulator (`hf-offload estimate`'s, the real step on
the meta device). One rung per piece, each on top of the ones before (`LADDER`, the same rungs
`gpu_long_context --stages ladder` measures on a GPU): the peak at 128k and at 1,048,576 tokens and
where it falls, the longest sequence on an 80 GB and on a 141 GB GPU (bisection on a 1024-token
grid, as every search), the bytes per token between 512k and 1M, and the step time the time model
predicts at 1M on an H200. Writes ladder.md and ladder.json under --out.

`--preset tiny --lengths 1024 2048 4096` runs the whole flow in seconds (the tests do).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import time
import warnings
from pathlib import Path

from hf_offload.tools.devices import DEVICES, step_seconds
from hf_offload.tools.estimate import forked_pool
from hf_offload.tools.presets import preset_config
from hf_offload.tools.simulator import Simulator, Training
from hf_offload.tools.simulator.search import longest_sequence

GIB = 2**30
MODE = "checkpointing+hf_offload+tiled"
# Each rung adds one piece to those above it (hf_offload.internal.longest_context_pieces).
LADDER = (
    ("tiling, before the pieces below", dict(heads=False, final_norm=False, embeddings=False, late_prefetch=False)),
    ("+ attention tiled over heads", dict(heads=True, final_norm=False, embeddings=False, late_prefetch=False)),
    ("+ the final norm with the loss head", dict(heads=True, final_norm=True, embeddings=False, late_prefetch=False)),
    ("+ the embeddings' output offloaded", dict(heads=True, final_norm=True, embeddings=True, late_prefetch=False)),
    ("+ the layer before back after the peak", dict(heads=True, final_norm=True, embeddings=True, late_prefetch=True)),
)
BUDGETS = {"80 GB": DEVICES["h100-80gb"].memory_gib, "141 GB": DEVICES["h200"].memory_gib}
# The peaks reported (a short and a long length) and the two the searches start from.
LENGTHS = (131072, 524288, 1048576)


def simulate_rung(task: tuple) -> dict:
    from hf_offload.internal import longest_context_pieces

    name, pieces, preset, lengths, budgets, granularity = task
    short, middle, long_ = lengths
    training = Training(lora_rank=16, optimizer_states=2, device=DEVICES["h200"])
    started = time.perf_counter()
    with longest_context_pieces(**pieces):
        simulator = Simulator(preset_config(preset), training)
        steps = {}

        def run(seq_len: int, trace: bool):
            if seq_len not in steps:
                steps[seq_len] = simulator.run(MODE, seq_len)
            return steps[seq_len]

        longest = {
            budget: longest_sequence(
                run,
                mode=MODE,
                memory_bytes=int(gib * GIB),
                workspace_bytes=training.device.workspace_bytes,
                granularity=granularity,
                lengths=(middle, long_),
            ).max_seq_len
            for budget, gib in budgets.items()
        }
        run(short, False)
    at = {n: steps[n] for n in (short, long_)}
    long_step = at[long_]
    row = {
        "rung": name,
        "pieces": pieces,
        "peak_gib": {str(n): round(step.peak_bytes / GIB, 2) for n, step in at.items()},
        "peak_at": {
            str(n): " ".join(str(part) for part in step.peak.tag) + f", {step.peak.op}" for n, step in at.items()
        },
        "host_gib_at_long": round(long_step.host_bytes / GIB, 1),
        "longest": longest,
        "mb_per_token": round((steps[long_].peak_bytes - steps[middle].peak_bytes) / (long_ - middle) / 1e6, 4),
        "step_seconds_at_long": float(
            f"{step_seconds(training.device, long_step.compute, long_step.traffic_bytes):.4g}"
        ),
        "simulated_steps": len(steps),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(f"  {name}: {longest} ({len(steps)} steps, {row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return row


def table(rows: list[dict], lengths: tuple[int, int, int]) -> str:
    """The rows as a markdown table (the 80 GB and 141 GB columns are the two budgets searched)."""
    short, middle, long_ = (f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths)
    lines = [
        f"| rung | peak at {short}, GiB | peak at {long_}, GiB | MB per token, {middle} to {long_} | "
        f"longest, 80 GB | longest, 141 GB | step s at {long_} (H200) | where the {long_} peak is |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peaks = list(row["peak_gib"].values())
        longest = [f"{row['longest'][b]:,}" if row["longest"][b] else "-" for b in BUDGETS]
        lines.append(
            f"| {row['rung']} | {peaks[0]:.2f} | {peaks[1]:.2f} | {row['mb_per_token']:.3f} | {longest[0]} | "
            f"{longest[1]} | {row['step_seconds_at_long']:,.4g} | {list(row['peak_at'].values())[1]} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write ladder.md and ladder.json here")
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--lengths", type=int, nargs=3, default=LENGTHS, help="the short peak and the search's two")
    parser.add_argument(
        "--memory-gib", type=float, nargs=2, default=None, help="the two budgets instead of 80 GB's and 141 GB's"
    )
    parser.add_argument("--granularity", type=int, default=1024, help="the searches' grid, in tokens")
    parser.add_argument("--jobs", type=int, default=1, help="rungs simulated at once (forked processes)")
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hf_offload").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    started = time.perf_counter()
    budgets = BUDGETS if args.memory_gib is None else dict(zip(BUDGETS, args.memory_gib, strict=True))
    tasks = [(name, pieces, args.preset, tuple(args.lengths), budgets, args.granularity) for name, pieces in LADDER]
    if args.jobs > 1:
        with forked_pool(args.jobs, multiprocessing.get_context("fork")) as pool:
            rows = list(pool.map(simulate_rung, tasks))
    else:
        rows = [simulate_rung(task) for task in tasks]
    text = table(rows, tuple(args.lengths))
    print(text)
    print(f"(simulated, {args.preset}, LoRA r=16, AdamW; {time.perf_counter() - started:.0f} s)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ladder.md").write_text(text + "\n")
        (args.out / "ladder.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
