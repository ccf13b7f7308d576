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
   tests/test_examples.py's GPU tests: `hf-offload demo` and each example's --compare --control);
3b. the longest-context recipe piece by piece (`--stages ladder`, docs/longest_context.md): one step
   of checkpointing + hf_offload + tiling at `--ladder-length` tokens per rung (tiling before the
   pieces of issue 24, then attention tiled over heads, the final norm with the loss head, the
   embeddings' output offloaded, the layer before back after the peak), peak and step time beside
   the simulator's peak;
3c. QLoRA (`--stages qlora`, docs/qlora.md): Llama-3.1-8B's shape loaded in 4 bits (nf4, double
   quantization, bf16 compute: QLoRA's recipe; random weights quantized on the device by
   bitsandbytes, as from_pretrained with the BitsAndBytesConfig quantizes them), LoRA r=32 on every
   linear layer, checkpointing + hf_offload + tiling at `--qlora-lengths` (32768 and 65536): peak
   and step time, each beside the simulator's; the longest sequence for this GPU and smaller ones
   from the measured slope beside the simulator's. Needs bitsandbytes (docs/benchmarks.md);
4. the disk tier (`--stages disk`, docs/tiers.md): the machine's disk through the tier against dd
   with direct I/O; the pool's exact-size pinned memory (registered) against torch's pinned
   allocator (is it pinned, does it copy as fast, how much torch's allocator rounds); whether
   GPUDirect Storage (torch.cuda.gds) works here; and checkpointing + hf_offload + tiling at
   `--disk-length` tokens with every layer input in host memory against most of them on disk:
   the step-time ratio (target <= 1.05x: the disk hides behind compute), the bytes and rates,
   the seconds waited on the disk, and the gradients of both equal bit for bit.

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

from hf_offload.tools.bench import MaxSeq, _probe, build_model, max_seq, max_seq_table, predict_max_seq
from hf_offload.tools.benchmarks.gpu_check import package_versions
from hf_offload.tools.benchmarks.ladder import LADDER
from hf_offload.tools.benchmarks.ladder import MODE as LADDER_MODE
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
STAGES = ("peaks", "tiling", "ladder", "qlora", "tests", "disk")
# The longest-context recipe piece by piece (docs/longest_context.md): each rung turns one more on.
DISK_TIME_LIMIT = 1.05  # step time with most layer inputs on disk / all in host memory
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


def ladder_stage(model, device: torch.device, length: int, simulator) -> None:
    """One step of checkpointing + hf_offload + tiling at `length` tokens per rung of LADDER: the
    measured peak and step time beside the simulator's peak for the same pieces."""
    from hf_offload.internal import longest_context_pieces

    print("| rung | peak GiB | simulated GiB | measured / simulated | step s |")
    print("|---|---|---|---|---|")
    for name, pieces in LADDER:
        with longest_context_pieces(**pieces):
            record = _probe(model, LADDER_MODE, length, 1, 1, device)
            simulated = simulator.run(LADDER_MODE, length).peak_bytes if simulator is not None else None
        peak = record.peak_device_bytes
        ratio = f"{peak / simulated:.4f}" if peak and simulated else "-"
        print(
            f"| {name} | {_gib(peak)} | {_gib(simulated)} | {ratio} | {record.step_seconds:.2f} |"
            if record.step_seconds
            else f"| {name} | {record.status} | | | |",
            flush=True,
        )


# QLoRA's recipe (nf4, double quantization, bf16 compute) with Unsloth's table's adapters (docs/qlora.md).
QLORA_MODE = "checkpointing+hf_offload+tiled"
QLORA_RANK = 32
QLORA_PRESET = "llama-3.1-8b"
# The cards QLoRA is for, as the estimate's presets leave them usable (the measured line, whose
# slices were sized for the GPU measured, predicts them roughly: theirs are smaller).
QLORA_BUDGETS = {f"an {name} ({DEVICES[name].memory_gib:g} GiB usable)": int(DEVICES[name].memory_gib * 2**30)
                 for name in ("rtx4090", "rtx4060ti-16gb")}  # fmt: skip


def qlora_stage(preset: str, device: torch.device, dtype: torch.dtype, lengths: tuple[int, int], *,
                budgets: dict[str, int | None], granularity: int, memory_limit: int | None) -> None:  # fmt: skip
    """A 4-bit base with LoRA r=32, the tiled recipe at two lengths: the peak and step time of each
    beside the simulator's, and the longest sequence for each budget from the measured slope beside
    the simulator's lines through the same two lengths."""
    from peft import LoraConfig, get_peft_model

    from hf_offload.tools.devices import step_seconds
    from hf_offload.tools.simulator.four_bit import FourBit, quantize

    model = quantize(build_model(preset, None, device, dtype), FourBit("nf4", True, torch.bfloat16), dtype)
    model = get_peft_model(model, LoraConfig(r=QLORA_RANK, target_modules="all-linear"))
    simulator = simulator_for(model, device=device)
    results = max_seq(model, modes=[QLORA_MODE], slope_lens=lengths, device=device, method="slope",
                      granularity=granularity, steps=1, memory_limit=memory_limit)  # fmt: skip
    print(max_seq_table(results, device=device))
    budgets = _measured_budgets(budgets, results, device)
    (result,) = results
    probes = [p for p in result.probes[:2] if p.status == "ok"]
    simulated = [simulator.run(QLORA_MODE, p.seq_len, trace=True) for p in probes]
    rates = simulator.training.device
    print("\nthe simulator beside the measurement (peak: allocated bytes; step: the time model at this GPU's rates):")
    print("| length | measured GiB | simulated GiB | measured / simulated | measured step s | simulated step s |")
    print("|---|---|---|---|---|---|")
    for probe, step in zip(probes, simulated, strict=True):
        measured = probe.peak_device_bytes
        ratio = "-" if measured is None else f"{measured / step.peak_bytes:.3f}"
        seconds = step_seconds(rates, step.compute, step.traffic_bytes)
        print(f"| {probe.seq_len} | {_gib(measured)} | {_gib(step.peak_bytes)} | {ratio} | "
              f"{probe.step_seconds or 0:.2f} | {seconds:.2f} |")  # fmt: skip
    print("\nthe longest sequence, from the two lengths (measured slope; simulated lines):")
    print("| budget | measured | simulated |")
    print("|---|---|---|")
    for name, budget in budgets.items():
        measured = "-"
        if result.bytes_per_token is not None:
            measured = predict_max_seq(result.bytes_per_token, result.fixed_bytes, budget, granularity) or "-"
        predicted = None
        if len(simulated) == 2:
            predicted = predict_longest(simulated[0], simulated[1], budget - rates.workspace_bytes)
        shown = "-" if predicted is None else predicted // granularity * granularity
        print(f"| {name} | {measured} | {shown} |")


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.3f}"


def run_tests(device: torch.device) -> int:
    if device.type != "cuda":
        print("GPU tests: skipped (no CUDA device)")
        return 0
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    tests = [str(TESTS / "test_gpu_liger.py"), str(TESTS / "test_examples.py")]
    return subprocess.run([*command, *tests], timeout=420).returncode


def pinned_memory_check(device: torch.device, nbytes: int = 1 << 30) -> None:
    """The pool's slabs on CUDA are registered anonymous memory at their exact size: pinned, and
    copied as fast as torch's pinned memory, which rounds each block up to a power of two."""
    if device.type != "cuda":
        print("pinned memory: skipped: needs a CUDA device")
        return
    from hf_offload.engine.streams import pinned_empty, registered_host_empty

    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    before = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)
    odd = pinned_empty(3 * nbytes // 2)
    rounded = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0) - before
    print(f"torch's pinned allocator: {3 * nbytes // 2} bytes asked, {rounded} reserved")
    del odd
    candidates = (("registered (the pool)", registered_host_empty(nbytes)), ("torch pinned", pinned_empty(nbytes)))
    for name, host in candidates:
        if host is None:
            print(f"{name}: cudaHostRegister refused")
            continue
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            target.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        rate = 5 * nbytes / (time.perf_counter() - started) / 1e9
        print(f"{name}: is_pinned {host.is_pinned()}, host to device {rate:.1f} GB/s")


def gds_check(directory: str, device: torch.device, nbytes: int = 1 << 30) -> None:
    """Whether GPUDirect Storage (cuFile through torch.cuda.gds) works on this machine, and its rate."""
    if device.type != "cuda":
        print("GPUDirect Storage: skipped: needs a CUDA device")
        return
    import os

    path = os.path.join(directory, "gds-probe")
    try:
        from torch.cuda.gds import GdsFile

        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        handle = GdsFile(path, os.O_CREAT | os.O_RDWR)
        torch.cuda.synchronize()
        started = time.perf_counter()
        handle.save_storage(source.untyped_storage(), offset=0)
        write = nbytes / (time.perf_counter() - started) / 1e9
        started = time.perf_counter()
        handle.load_storage(source.untyped_storage(), offset=0)
        read = nbytes / (time.perf_counter() - started) / 1e9
        print(f"GPUDirect Storage: works here: write {write:.2f} GB/s, read {read:.2f} GB/s (device memory to file)")
        del handle
    except Exception as error:  # noqa: BLE001 - a probe: any failure is the answer
        print(f"GPUDirect Storage: not available here ({type(error).__name__}: {str(error)[:160]})")
    finally:
        if os.path.exists(path):
            os.unlink(path)


def disk_tier_step(model, device, length: int, directory: str, cpu: bool, steps: int = 2) -> str:
    """Checkpointing + hf_offload + tiling at `length` tokens: every layer input in host memory,
    then most of them on disk (a host budget of a quarter of them). Step time ratio, what moved,
    what was waited for, and the gradients compared bit for bit."""
    import hf_offload

    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    model.train()
    model.activation_checkpointing_enable()
    hf_offload.enable_sequence_tiling(model)
    results = {}
    budget = None
    for name in ("host memory", "disk tier"):
        options = {"simulate_on_cpu": cpu, "min_offload_bytes": 0} if cpu else {}
        if name == "disk tier":
            options.update(disk_dir=directory, max_host_bytes=budget)
        hf_offload.enable_activation_offloading(model, **options)
        seconds = []
        for step in range(steps + 1):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step:
                seconds.append(time.perf_counter() - started)
        stats = model.activation_offloading_stats()
        gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (min(seconds), stats, gradients)
        if budget is None:  # a quarter of the layer inputs stay in host memory, the rest go to disk
            budget = max(stats.offloaded_bytes // 4, 1 << 12)
        hf_offload.disable_activation_offloading(model)
    hf_offload.disable_sequence_tiling(model)
    model.zero_grad(set_to_none=True)
    (host, _, expected), (disk, stats, actual) = results["host memory"], results["disk tier"]
    same = expected.keys() == actual.keys() and all(torch.equal(expected[n], actual[n]) for n in expected)
    ratio = disk / host
    verdict = "met" if ratio <= DISK_TIME_LIMIT else "MISSED"
    lines = [
        "| length | host memory s | disk tier s | disk / host | limit | layers on disk | written | read | "
        "write GB/s | read GB/s | waited on disk s | gradients equal |",
        "|---" * 12 + "|",
        f"| {length} | {host:.2f} | {disk:.2f} | {ratio:.3f}x | <= {DISK_TIME_LIMIT:.2f}x ({verdict}) | "
        f"{stats.layers_on_disk} | {stats.disk_bytes_written / 2**30:.2f} GiB | {stats.disk_bytes_read / 2**30:.2f} GiB"
        f" | {stats.disk_write_gbps or 0:.2f} | {stats.disk_read_gbps or 0:.2f} | {stats.disk_wait_seconds:.3f} | "
        f"{same} |",
    ]
    return "\n".join(lines)


def disk_stage(model, device, length: int, disk_dir: str | None, cpu: bool) -> int:
    import shutil
    import tempfile

    from hf_offload.tools.benchmarks import disk_tier

    directory = tempfile.mkdtemp(prefix="hf_offload-disk-", dir=disk_dir)
    try:
        total = (64 if cpu else 4096) * 2**20
        print("throughput of this machine's disk, the tier against dd with direct I/O:")
        dd_write, dd_read = disk_tier.dd_throughput(directory, total, 64 * 2**20)
        write, read, intact = disk_tier.tier_throughput(directory, total, 64 * 2**20)
        if dd_write and dd_read:
            print(f"tier / dd: write {write / dd_write:.2f}x, read {read / dd_read:.2f}x (target >= 0.8x)")
        pinned_memory_check(device)
        gds_check(directory, device)
        print(f"\ncheckpointing + hf_offload + tiling at {length} tokens, host memory against the disk tier:")
        print(disk_tier_step(model, device, length, directory, cpu, steps=1 if cpu else 2))
        return 0 if intact else 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=None, help="the slope's two lengths (4096 8192)")
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument(
        "--tiling-lengths", type=int, nargs=2, default=None, help="the tiling stage's two lengths (32768 131072)"
    )
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="default: all")
    parser.add_argument("--disk-length", type=int, default=None, help="the disk stage's length (65536)")
    parser.add_argument("--ladder-length", type=int, default=None, help="the ladder stage's length (131072)")
    parser.add_argument(
        "--qlora-lengths", type=int, nargs=2, default=None, help="the qlora stage's two lengths (32768 65536)"
    )
    parser.add_argument("--disk-dir", default=None, help="where the disk stage writes (default: the temp dir)")
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

    stages = [stage for stage in args.stages if not (stage == "tests" and args.skip_tests)]
    # First, with nothing else on the device: its model is its own (the others share one, below).
    if "qlora" in stages:
        first, second = args.qlora_lengths or ((512, 1024) if args.cpu_smoke else (32768, 65536))
        print(f"\n== 3c. QLoRA: {QLORA_PRESET if not args.cpu_smoke else preset} in 4 bits, LoRA r={QLORA_RANK}, at "
              f"{first} and {second} tokens ({time.perf_counter() - started:.0f} s in) ==", flush=True)  # fmt: skip
        qlora_budgets = budgets if args.cpu_smoke else dict(budgets, **QLORA_BUDGETS)
        qlora_stage("tiny" if args.cpu_smoke else QLORA_PRESET, device, dtype, (first, second), budgets=qlora_budgets,
                    granularity=args.granularity, memory_limit=memory_limit)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not set(stages) & {"peaks", "tiling", "ladder", "disk", "tests"}:
        print(f"\n== done in {time.perf_counter() - started:.0f} s, exit status 0 ==")
        return 0
    model = build_model(preset, None, device, dtype)
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
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
    if "ladder" in stages:
        length = args.ladder_length or (512 if args.cpu_smoke else 131072)
        print(f"\n== 3b. the longest-context recipe piece by piece, at {length} tokens "
              f"({time.perf_counter() - started:.0f} s in) ==", flush=True)  # fmt: skip
        ladder_stage(model, device, length, simulator)
    status = 0
    if "disk" in stages:
        length = args.disk_length or (256 if args.cpu_smoke else 65536)
        print(f"\n== 5. the disk tier ({time.perf_counter() - started:.0f} s in) ==", flush=True)
        status = disk_stage(model, device, length, args.disk_dir, cpu=device.type == "cpu")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "tests" in stages:
        print(f"\n== 4. GPU tests ({time.perf_counter() - started:.0f} s in) ==", flush=True)
        status = run_tests(device) or status
    print(f"\n== done in {time.perf_counter() - started:.0f} s, exit status {status} ==")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
