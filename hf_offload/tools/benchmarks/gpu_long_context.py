"""The longest context per GPU, measured: the second GPU command, after `gpu_check`.

    python -m hf_offload.tools.benchmarks.gpu_long_context [--lengths 4096 8192] [--skip-tests]

Llama-3-8B's shape with LoRA r=16 on every linear layer (PEFT's fp32 adapters), bf16 weights built
on the device, batch 1, non-reentrant checkpointing in every mode:

1. for checkpointing, checkpointing + Liger's fused linear cross-entropy (FLCE), checkpointing +
   hf_offload and checkpointing + hf_offload + FLCE: the peak device memory at two lengths, the
   bytes per token fitted through them, and the longest sequence predicted to fit this device and
   an 80 GB one (`hf-offload bench --find-max-seq --method slope`: a step at 400k tokens of an 8B
   model takes minutes, so the maxima are predicted, not run); and the step time at the longer
   length;
2. the targets of the longest-context work, each with its figure: checkpointing + hf_offload +
   FLCE reaches at least 2x the maximum of checkpointing + FLCE and 5x that of checkpointing
   alone, at a step time at most 1.03x that of checkpointing + FLCE;
3. the GPU tests that need Liger or run the examples (tests/test_gpu_liger.py, and
   tests/test_examples.py's GPU tests: `hf-offload demo` and each example's --compare --control).

Carry liger-kernel (and transformers, peft, trl) as wheels: see docs/benchmarks.md. Meant to take
about 5 minutes on one H200 (estimated: the 8B build, eight steps per mode, Triton's first
compilation of Liger's kernels, the tests). `--cpu-smoke` runs the same stages on the CPU with
the tiny preset, where Liger's Triton kernels fail and are recorded as failed: it checks this
script, not a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_offload.tools.bench import MaxSeq, build_model, max_seq, max_seq_table, predict_max_seq
from hf_offload.tools.benchmarks.gpu_check import package_versions
from hf_offload.tools.devices import DEVICES
from hf_offload.tools.fidelity import simulator_for
from hf_offload.tools.simulator.search import predict_longest

TESTS = Path(__file__).resolve().parents[3] / "tests"
MODES = (
    "checkpointing",
    "checkpointing+liger",
    "checkpointing+hf_offload",
    "checkpointing+hf_offload+liger",
)
OURS = "checkpointing+hf_offload+liger"
# Sequence tiling, at lengths where it tiles: the same stack untiled and tiled (the time targets),
# and tiling with its own loss head in place of Liger's.
TILING_MODES = (
    "checkpointing+hf_offload+liger",
    "checkpointing+hf_offload+liger+tiled",
    "checkpointing+hf_offload+tiled",
)
TILING_TIME_LIMITS = (1.10, 1.05)  # tiled / untiled step time, at the first and the second length
STAGES = ("peaks", "tiling", "tests")
EIGHTY_GB = int(DEVICES["h100-80gb"].memory_gib * 2**30)  # what an 80 GB GPU leaves usable (estimate's preset)


def _by_mode(results: list[MaxSeq]) -> dict[str, MaxSeq]:
    return {result.mode: result for result in results}


def predictions_table(results: list[MaxSeq], *, budgets: dict[str, int], granularity: int) -> str:
    lines = [
        "| mode | bytes per token | fixed GiB | " + " | ".join(f"max seq, {name}" for name in budgets) + " |",
        "|---|---|---|" + "---|" * len(budgets),
    ]
    for result in results:
        if result.bytes_per_token is None:
            lines.append(f"| {result.mode} | {result.status} | - |" + " - |" * len(budgets))
            continue
        maxima = [
            predict_max_seq(result.bytes_per_token, result.fixed_bytes, budget, granularity)
            for budget in budgets.values()
        ]
        lines.append(
            f"| {result.mode} | {result.bytes_per_token / 1e6:.3f} MB | {result.fixed_bytes / 2**30:.2f} | "
            + " | ".join("-" if m is None else f"{m}" for m in maxima)
            + " |"
        )
    return "\n".join(lines)


def simulated_table(results: list[MaxSeq], simulator, *, budgets: dict[str, int], granularity: int) -> str:
    """The simulator beside the measurement: its peak at each measured length (measured /
    simulated), and the longest sequence it predicts from the same two lengths for each budget
    (its per-op lines, not verified by a search)."""
    workspace = simulator.training.device.workspace_bytes
    lines = [
        "| mode | length | measured GiB | simulated GiB | measured / simulated | "
        + " | ".join(f"simulated max seq, {name}" for name in budgets)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(budgets),
    ]
    for result in results:
        probes = [p for p in result.probes[:2] if p.status == "ok"]
        if len(probes) < 2:
            lines.append(f"| {result.mode} | - | {result.status} | - | - |" + " - |" * len(budgets))
            continue
        simulated = [simulator.run(result.mode, p.seq_len, trace=True) for p in probes]
        maxima = []
        for budget in budgets.values():
            longest = predict_longest(simulated[0], simulated[1], budget - workspace)
            maxima.append("-" if longest is None else str(longest // granularity * granularity))
        for index, (probe, step) in enumerate(zip(probes, simulated, strict=True)):
            measured = probe.peak_device_bytes
            ratio = "-" if measured is None else f"{measured / step.peak_bytes:.3f}"
            shown = "-" if measured is None else f"{measured / 2**30:.2f}"
            tail = " | ".join(maxima) if index == 0 else " | ".join("" for _ in maxima)
            lines.append(
                f"| {result.mode} | {probe.seq_len} | {shown} | {step.peak_bytes / 2**30:.2f} | {ratio} | {tail} |"
            )
    return "\n".join(lines)


def targets_table(results: list[MaxSeq], *, budget: int, granularity: int) -> str:
    found = _by_mode(results)

    def maximum(mode: str) -> int | None:
        result = found.get(mode)
        if result is None or result.bytes_per_token is None:
            return None
        return predict_max_seq(result.bytes_per_token, result.fixed_bytes, budget, granularity)

    def step_seconds(mode: str) -> float | None:
        result = found.get(mode)
        if result is None or not result.probes or result.probes[-1].status != "ok":
            return None
        return result.probes[-1].step_seconds

    ours, liger, alone = (maximum(m) for m in (OURS, "checkpointing+liger", "checkpointing"))
    lines = ["| target | figure | verdict |", "|---|---|---|"]

    def row(name: str, value: float | None, limit: float, at_least: bool) -> None:
        if value is None:
            lines.append(f"| {name} | not measured | - |")
            return
        met = value >= limit if at_least else value <= limit
        lines.append(f"| {name} | {value:.2f}x | {'met' if met else 'MISSED'} |")

    row("max seq: ckpt+hf_offload+FLCE vs ckpt+FLCE (>= 2x)", ours / liger if ours and liger else None, 2.0, True)
    row("max seq: ckpt+hf_offload+FLCE vs ckpt alone (>= 5x)", ours / alone if ours and alone else None, 5.0, True)
    faster, base = step_seconds(OURS), step_seconds("checkpointing+liger")
    row(
        "step time: ckpt+hf_offload+FLCE vs ckpt+FLCE (<= 1.03x)",
        faster / base if faster and base else None,
        1.03,
        False,
    )
    return "\n".join(lines)


def _measured_budgets(budgets: dict[str, int | None], results: list[MaxSeq], device) -> dict[str, int]:
    """This GPU's budget, as the runs read it, in place of its placeholder; budgets without a figure go."""
    budgets = dict(budgets)
    first = next(iter(budgets))
    if device.type == "cuda" and budgets[first] is None:
        budgets[first] = next((r.budget_bytes for r in results if r.budget_bytes), None)
    return {name: budget for name, budget in budgets.items() if budget}


def tiling_table(results: list[MaxSeq], *, untiled: str, tiled: str, limits=TILING_TIME_LIMITS) -> str:
    """Tiling's cost in step time: tiled / untiled, the same stack at the same length, against its
    limit at each length."""
    found = _by_mode(results)
    lines = ["| length | untiled step s | tiled step s | tiled / untiled | limit | verdict |", "|---" * 6 + "|"]
    before, after = found.get(untiled), found.get(tiled)
    for index, limit in enumerate(limits):
        pair = [r.probes[index] if r is not None and len(r.probes) > index else None for r in (before, after)]
        if any(p is None or p.status != "ok" or not p.step_seconds for p in pair):
            length = next((p.seq_len for p in pair if p is not None), "-")
            lines.append(f"| {length} | - | - | not measured | <= {limit:.2f}x | - |")
            continue
        ratio = pair[1].step_seconds / pair[0].step_seconds
        verdict = "met" if ratio <= limit else "MISSED"
        lines.append(
            f"| {pair[0].seq_len} | {pair[0].step_seconds:.2f} | {pair[1].step_seconds:.2f} | {ratio:.3f}x | "
            f"<= {limit:.2f}x | {verdict} |"
        )
    return "\n".join(lines)


def run_tests(device: torch.device) -> int:
    if device.type != "cuda":
        print("GPU tests: skipped (no CUDA device)")
        return 0
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    tests = [str(TESTS / "test_gpu_liger.py"), str(TESTS / "test_examples.py")]
    return subprocess.run([*command, *tests], timeout=420).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=None, help="the slope's two lengths (4096 8192)")
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument(
        "--tiling-lengths", type=int, nargs=2, default=None, help="the tiling stage's two lengths (32768 131072)"
    )
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="default: all three")
    parser.add_argument("--skip-tests", action="store_true", help="the same as leaving 'tests' out of --stages")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every stage on the CPU (tiny model)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, dtype, preset = torch.device("cpu"), torch.float32, "tiny"
        lengths, memory_limit = tuple(args.lengths or (1024, 2048)), 2**28
        tiling_lengths = tuple(args.tiling_lengths or (1024, 2048))
        budgets = {"the CPU limit (256 MiB of byte accounting)": memory_limit}
    elif torch.cuda.is_available():
        device, dtype, preset = torch.device("cuda"), torch.bfloat16, "llama-3-8b"
        lengths, memory_limit = tuple(args.lengths or (4096, 8192)), None
        tiling_lengths = tuple(args.tiling_lengths or (32768, 131072))
        budgets = {f"this {torch.cuda.get_device_name()}": None, "an 80 GB GPU": EIGHTY_GB}
    else:
        print("no CUDA device: this check needs one (--cpu-smoke checks the script on the CPU)")
        return 2
    started = time.perf_counter()
    print(f"date: {datetime.date.today().isoformat()}")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run (tiny preset)"
    print(f"device: {where}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"packages: {package_versions()}; preset {preset}, LoRA r=16 on all linears, {str(dtype)[6:]}, batch 1")

    model = build_model(preset, None, device, dtype)
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    stages = [stage for stage in args.stages if not (stage == "tests" and args.skip_tests)]
    simulator = simulator_for(model, device=device)
    measure = dict(device=device, method="slope", granularity=args.granularity, steps=1, memory_limit=memory_limit)
    if "peaks" in stages:
        print(f"\n== 1. peaks at {lengths[0]} and {lengths[1]} tokens ({time.perf_counter() - started:.0f} s in) ==")
        results = max_seq(model, modes=list(MODES), slope_lens=lengths, **measure)
        print(max_seq_table(results, device=device))
        budgets = _measured_budgets(budgets, results, device)
        print()
        print(predictions_table(results, budgets=budgets, granularity=args.granularity))
        print("\nthe simulator beside the measurement (hf-offload estimate, the same setup on the meta device):")
        print(simulated_table(results, simulator, budgets=budgets, granularity=args.granularity))
        print(f"\n== 2. targets, on {next(iter(budgets))} ==")
        print(targets_table(results, budget=next(iter(budgets.values())), granularity=args.granularity))
    if "tiling" in stages:
        first, second = tiling_lengths
        print(f"\n== 3. sequence tiling at {first} and {second} tokens ({time.perf_counter() - started:.0f} s in) ==")
        results = max_seq(model, modes=list(TILING_MODES), slope_lens=tiling_lengths, **measure)
        print(max_seq_table(results, device=device))
        budgets = _measured_budgets(budgets, results, device)
        print("\nthe simulator beside the measurement, and the longest sequence from these two lengths:")
        print(simulated_table(results, simulator, budgets=budgets, granularity=args.granularity))
        print(f"\ntiling's cost in step time ({TILING_MODES[1]} against {TILING_MODES[0]}):")
        print(tiling_table(results, untiled=TILING_MODES[0], tiled=TILING_MODES[1]))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    status = 0
    if "tests" in stages:
        print(f"\n== 4. GPU tests ({time.perf_counter() - started:.0f} s in) ==", flush=True)
        status = run_tests(device)
    print(f"\n== done in {time.perf_counter() - started:.0f} s, exit status {status} ==")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
