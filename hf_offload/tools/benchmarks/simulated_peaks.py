"""At which sequence length does fine-tuning a 7-8B model run out of memory, in each mode?

    python -m hf_offload.tools.benchmarks.simulated_peaks [--out docs/img] [--jobs 2]

Simulated with `hf-offload estimate`'s simulator (the real step on the meta device), validated
against the H200's measured peaks (docs/estimate.md). For Llama-3-8B and Qwen2-7B, LoRA r=16 on
every linear layer (PEFT's fp32 adapters) and full fine-tuning, bf16, batch 1, an AdamW step:
each mode's peak against the sequence length (the largest of its ops' lines through two
simulated lengths; for the tiled mode, whose steps run more slices at longer lengths, the peak's
own line), the 80 GB and 141 GB lines, and the longest sequence each fits, found by bisection on a
1024-token grid (marked x). The tiled mode (sequence tiling of the MLPs, norms, projections and
loss head, docs/longest_context.md) starts its search at 16 slices (`search_lengths`), where its
peak's line holds. The H200's measured peaks are drawn where they exist (8B LoRA; measured
without the optimizer step, 0.3 GiB less; hf_offload/tools/measured/). Writes simulated_peaks.png,
simulated_peaks.md and simulated_peaks.json.

`--presets tiny --lengths 256 512` runs the whole flow in seconds on a tiny model (the tests do).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

from hf_offload.tools import measured
from hf_offload.tools.devices import DEVICES
from hf_offload.tools.estimate import forked_pool
from hf_offload.tools.presets import preset_config
from hf_offload.tools.simulator import Simulator, Training
from hf_offload.tools.simulator.search import longest_sequence, search_lengths

GIB = 2**30
MODES = (
    "none",
    "hf_offload",
    "checkpointing",
    "checkpointing+hf_offload",
    "checkpointing+hf_offload+liger",
    "checkpointing+hf_offload+tiled",
)
BUDGETS = {"80 GB": DEVICES["h100-80gb"], "141 GB": DEVICES["h200"]}
# (preset, LoRA rank or None) -> {(mode, tokens): measured GiB}: the H200's (hf_offload/tools/measured/).
MEASURED: dict[tuple, dict[tuple, float]] = {}
for (_model, _rank, _mode, _tokens), _gib in measured.peaks_gib().items():
    MEASURED.setdefault((_model, _rank), {})[(_mode, _tokens)] = _gib


def simulate_panel(task: tuple) -> dict:
    """One model and tuning: each mode's two traced steps, and its longest sequence per budget."""
    preset, lora_rank, modes, untiled_lengths, untiled_granularity, budgets, tiled = task
    BUDGETS.clear()
    BUDGETS.update(budgets)
    simulator = Simulator(
        preset_config(preset), Training(lora_rank=lora_rank, optimizer_states=2, tile_tokens=tiled["tile_tokens"])
    )
    panel = {"preset": preset, "lora_rank": lora_rank, "modes": {}}
    for mode in modes:
        steps = {}
        if "+tiled" in mode:
            lengths = tiled["lengths"] or search_lengths(simulator.config, simulator.training, mode, untiled_lengths[0])
            granularity = tiled["granularity"] or untiled_granularity
        else:
            lengths, granularity = untiled_lengths, untiled_granularity

        def run(seq_len: int, trace: bool, mode=mode, steps=steps):
            if seq_len not in steps or (trace and steps[seq_len].trace is None):
                steps[seq_len] = simulator.run(mode, seq_len, trace=trace)
            return steps[seq_len]

        entry = {"lines": None, "longest": {}}
        for name, device in BUDGETS.items():
            found = longest_sequence(
                run,
                mode=mode,
                memory_bytes=int(device.memory_gib * GIB),
                workspace_bytes=device.workspace_bytes,
                granularity=granularity,
                lengths=lengths,
            )
            at = found.at_max
            entry["longest"][name] = {
                "max_seq_len": found.max_seq_len,
                "peak_bytes": at.peak_bytes if at else None,
                "host_bytes": at.host_bytes if at else None,
            }
        short, long_ = (steps[n] for n in lengths)
        same_ops = len(short.trace) == len(long_.trace)  # not when tiling runs more slices at the longer length
        # Else the peak's own line and one per phase and module (as the search predicts).
        common = [tag for tag in short.tag_peaks if tag in long_.tag_peaks]
        entry["lines"] = {
            "lengths": list(lengths),
            "short": short.trace if same_ops else [short.tracked_peak_bytes, *(short.tag_peaks[t] for t in common)],
            "long": long_.trace if same_ops else [long_.tracked_peak_bytes, *(long_.tag_peaks[t] for t in common)],
            "workspace_bytes": short.workspace_bytes,
        }
        entry["granularity"] = granularity
        entry["peaks"] = {str(n): step.peak_bytes for n, step in sorted(steps.items())}
        entry["seconds"] = round(sum(step.seconds for step in steps.values()), 1)
        panel["modes"][mode] = entry
        tuning = f"LoRA r={lora_rank}" if lora_rank else "full"
        found = ", ".join(f"{name} {v['max_seq_len']}" for name, v in entry["longest"].items())
        print(f"  {preset} {tuning} {mode}: {found} ({len(steps)} steps, {entry['seconds']:.0f} s)", file=sys.stderr,
              flush=True)  # fmt: skip
        for step in steps.values():
            step.trace = None
    return panel


def peak_at(lines: dict, tokens: float) -> float:
    """The largest of the per-op lines at `tokens` (bytes), with the workspaces."""
    first, second = lines["lengths"]
    span = second - first
    top = max(s + (l_ - s) * (tokens - first) / span for s, l_ in zip(lines["short"], lines["long"], strict=True))
    return top + lines["workspace_bytes"]


def plot(panels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 2 if len(panels) > 1 else 1
    rows = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.5 * rows), sharey=True, squeeze=False)
    for axis, panel in zip(axes.flat, panels, strict=False):
        longest_any = max(
            (v["max_seq_len"] or 0) for entry in panel["modes"].values() for v in entry["longest"].values()
        )
        top = max(4096, int(longest_any * 1.5))
        grid = [2 ** (12 + i / 8) for i in range(int(8 * (top.bit_length() - 12)) + 1)]
        for mode, entry in panel["modes"].items():
            (line,) = axis.plot(grid, [peak_at(entry["lines"], n) / GIB for n in grid], label=mode)
            for name, device in BUDGETS.items():
                longest = entry["longest"][name]["max_seq_len"]
                if longest:
                    axis.plot([longest], [device.memory_gib], marker="x", markersize=10, mew=2, color=line.get_color())
        for (_mode, tokens), gib in MEASURED.get((panel["preset"], panel["lora_rank"]), {}).items():
            axis.plot([tokens], [gib], marker="o", color="black", linestyle="none")
        for name, device in BUDGETS.items():
            axis.axhline(device.memory_gib, color="grey", linestyle=":", linewidth=1)
            axis.text(grid[0], device.memory_gib + 1, f"{name} ({device.memory_gib:g} GiB usable)", fontsize=7)
        tuning = f"LoRA r={panel['lora_rank']}" if panel["lora_rank"] else "full fine-tuning"
        axis.set_title(f"{panel['preset']}, {tuning}, bf16, batch 1, AdamW", fontsize=9)
        axis.set_xscale("log", base=2)
        axis.set_ylim(0, max(device.memory_gib for device in BUDGETS.values()) * 1.15)
        axis.set_xlabel("sequence length (tokens)")
        axis.set_ylabel("peak device memory, GiB (simulated)")
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="upper left")
    axes.flat[0].plot([], [], marker="o", color="black", linestyle="none", label="measured on an H200")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    figure.suptitle(
        "Simulated peak memory per mode (hf-offload estimate, validated against 20 H200 peaks); x: out of memory",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(panels: list[dict]) -> str:
    last = list(BUDGETS)[-1]
    lines = [
        "| model | tuning | mode | "
        + " | ".join(f"longest, {name}" for name in BUDGETS)
        + f" | host GiB there ({last}) |",
        "|---|---|---|" + "---|" * len(BUDGETS) + "---|",
    ]
    for panel in panels:
        tuning = f"LoRA r={panel['lora_rank']}" if panel["lora_rank"] else "full"
        for mode, entry in panel["modes"].items():
            values = [entry["longest"][name]["max_seq_len"] for name in BUDGETS]
            host = entry["longest"][last]["host_bytes"]
            shown = " | ".join("none" if v is None else f"{v:,}" for v in values)
            host_text = "-" if host is None else f"{host / GIB:.0f}"
            lines.append(f"| {panel['preset']} | {tuning} | {mode} | {shown} | {host_text} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["llama-3-8b", "qwen2-7b"])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--lengths", type=int, nargs=2, default=[8192, 16384])
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument(
        "--tiled-lengths", type=int, nargs=2, default=None, help="the +tiled modes' lengths (default: 16, 32 slices)"
    )
    parser.add_argument("--tiled-granularity", type=int, default=None, help="the +tiled modes' grid (--granularity)")
    parser.add_argument("--tile-tokens", type=int, default=None, help="the +tiled modes' slice (default: tiling's)")
    parser.add_argument("--tunings", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    parser.add_argument(
        "--budgets", type=float, nargs="+", default=None, metavar="GIB",
        help="device memories instead of 80 and 141 GB (a tiny model's smoke run)",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="processes, one panel each at a time")
    parser.add_argument("--out", default="simulated_peaks_out")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    # transformers and hf_offload speak up about what the simulation does on purpose, once per step.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hf_offload").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.budgets:
        base = DEVICES["h200"]
        BUDGETS.clear()
        BUDGETS.update({f"{gib:g} GiB": replace(base, memory_gib=gib) for gib in args.budgets})
    ranks = [16 if tuning == "lora" else None for tuning in args.tunings]
    tiled_lengths = None if args.tiled_lengths is None else tuple(args.tiled_lengths)
    tiled = dict(lengths=tiled_lengths, granularity=args.tiled_granularity, tile_tokens=args.tile_tokens)
    tasks = [
        (preset, rank, tuple(args.modes), tuple(args.lengths), args.granularity, dict(BUDGETS), tiled)
        for preset in args.presets
        for rank in ranks
    ]
    if args.jobs > 1:
        with forked_pool(args.jobs, multiprocessing.get_context("fork")) as pool:
            panels = list(pool.map(simulate_panel, tasks))
    else:
        panels = [simulate_panel(task) for task in tasks]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(panels)
    (out / "simulated_peaks.md").write_text(text + "\n")
    (out / "simulated_peaks.json").write_text(json.dumps(
        [{**panel, "modes": {m: {k: v for k, v in e.items() if k != "lines"} for m, e in panel["modes"].items()}}
         for panel in panels], indent=2))  # fmt: skip
    plot(panels, out / "simulated_peaks.png")
    print(text)
    print(f"wrote {out}/simulated_peaks.png, .md and .json in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
