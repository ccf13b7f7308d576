"""The GPU check: one command that measures what the package claims on a real accelerator.

    python -m hf_offload.tools.benchmarks.gpu_check [--seq-lens 4096 16384] [--steps 3] [--skip-tests]

Llama-3.2-1B's shape (random weights, bf16, batch 1), on one CUDA device:

1. the sweep: peak device memory and step time of every `hf-offload bench` mode (no offloading,
   hf_offload, checkpointing, checkpointing + hf_offload, both with a device-memory budget
   (`_auto`), transformers' offload=True, TRL's offloading) at each length, with the ratios the
   targets are stated in, and for each length how the budget modes compare with the fastest
   mode that fits;
2. where the time goes at the first length: the CPU time to issue forward and backward against
   their GPU time (CUDA events), checkpointing against checkpointing + hf_offload;
3. synchronising calls per step under torch.cuda.set_sync_debug_mode("warn"), with and without
   hf_offload (the engine must add none);
4. LoRA rows: the same model with LoRA r=16 on every linear layer, at one length;
5. the GPU tests (tests/test_gpu.py and the bench's allocator-limit test) and the parity tests
   again under PyTorch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1).

Needs no network. Meant to finish within 6 minutes on one H100/H200-class GPU. The longest-context
measurements (8B shape, Liger) are a second command: `python -m hf_offload.tools.benchmarks.gpu_long_context`.

`--cpu-smoke` runs every stage on the CPU with the tiny preset and the engine in simulation, with
the CUDA-only measurements reported as skipped: it checks this script, not a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import hf_offload
from hf_offload.tools.bench import Record, _configure, build_model, markdown_table, random_ids, sweep
from hf_offload.tools.fidelity import annotate, simulator_for
from hf_offload.tools.modes import MODES

TESTS = Path(__file__).resolve().parents[3] / "tests"
BUDGET_MODES = ("hf_offload_auto", "checkpointing+hf_offload_auto")
LORA_MODES = tuple(mode for mode in MODES if mode != "transformers_offload")  # its 1B figures are enough


def ratios_table(records, seq_lens) -> str:
    by_key = {(r.mode, r.seq_len): r for r in records if r.status == "ok"}
    lines = [
        "| seq | mode | peak vs none | time vs none | time vs checkpointing | peak vs trl | time vs trl |",
        "|---|---|---|---|---|---|---|",
    ]

    def ratio(record, base, field):
        if base is None or getattr(record, field) is None or not getattr(base, field):
            return "-"
        return f"{getattr(record, field) / getattr(base, field):.3f}x"

    for seq_len in seq_lens:
        none, ckpt, trl = (by_key.get((mode, seq_len)) for mode in ("none", "checkpointing", "trl_offload"))
        for mode in dict.fromkeys(r.mode for r in records):
            record = by_key.get((mode, seq_len))
            if record is None:
                continue
            lines.append(
                f"| {seq_len} | {mode} | {ratio(record, none, 'peak_device_bytes')} "
                f"| {ratio(record, none, 'step_seconds')} | {ratio(record, ckpt, 'step_seconds')} "
                f"| {ratio(record, trl, 'peak_device_bytes')} | {ratio(record, trl, 'step_seconds')} |"
            )
    return "\n".join(lines)


def budget_table(records, seq_lens) -> str:
    """The budget target: at every length, each `_auto` mode's step time against the fastest mode
    that fitted (at most 1.05x), and never out of memory where full offloading fitted. The
    checkpointing budget mode is held to the fastest mode that also recomputes (checkpointing,
    with or without offloading), since recomputing costs what it costs whatever the budget."""
    lines = [
        "| seq | budget mode | status | layers kept | time vs fastest that fits | fastest | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for seq_len in seq_lens:
        at = [r for r in records if r.seq_len == seq_len]
        for mode in BUDGET_MODES:
            record = next((r for r in at if r.mode == mode), None)
            if record is None:
                continue
            full = next((r for r in at if r.mode == mode.replace("_auto", "")), None)
            if record.status != "ok":
                met = "MISSED" if full is not None and full.status == "ok" else "-"
                lines.append(f"| {seq_len} | {mode} | {record.status} | - | - | - | {met} |")
                continue
            family = [r for r in at if r.status == "ok" and r.step_seconds]
            if mode.startswith("checkpointing"):
                family = [r for r in family if r.mode.startswith("checkpointing")]
            fastest = min(family, key=lambda r: r.step_seconds)
            ratio = record.step_seconds / fastest.step_seconds
            met = "met" if ratio <= 1.05 else "MISSED"
            lines.append(
                f"| {seq_len} | {mode} | ok | {record.layers_kept_for_budget} | {ratio:.3f}x | {fastest.mode} | {met} |"
            )
    return "\n".join(lines)


def package_versions() -> str:
    """The versions the figures depend on, as imported (a carried wheel can shadow the system's)."""
    import importlib

    versions = []
    for name in ("transformers", "peft", "trl", "accelerate", "liger_kernel"):
        try:
            module = importlib.import_module(name)
            versions.append(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError:
            versions.append(f"{name} not installed")
    return ", ".join(versions)


def issue_against_gpu_time(model, seq_len: int, device: torch.device, repeats: int = 5) -> str:
    """Per mode, the best of `repeats` steps: CPU time to issue forward and backward (the calls'
    wall time) against the GPU time between CUDA events recorded around them. A forward whose
    issue time comes close to its GPU time leaves the GPU waiting for the CPU."""
    if device.type != "cuda":
        return "skipped: CUDA events need a CUDA device"
    ids = random_ids(model, 1, seq_len, device)
    lines = [
        f"| mode ({seq_len} tokens) | forward: CPU issue / GPU ms | backward: CPU issue / GPU ms | step ms |",
        "|---|---|---|---|",
    ]
    for mode in ("checkpointing", "checkpointing+hf_offload"):
        _configure(model, mode, device)
        samples = []
        for index in range(repeats + 1):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            events[0].record()
            loss = model(input_ids=ids, labels=ids).loss
            middle = time.perf_counter()
            events[1].record()
            loss.backward()
            end = time.perf_counter()
            events[2].record()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if index:  # the first is a warm-up
                gpu = (events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2]))
                samples.append((wall, (middle - start) * 1e3, gpu[0], (end - middle) * 1e3, gpu[1]))
        wall, forward_cpu, forward_gpu, backward_cpu, backward_gpu = min(samples)
        lines.append(
            f"| {mode} | {forward_cpu:.1f} / {forward_gpu:.1f} | {backward_cpu:.1f} / {backward_gpu:.1f} "
            f"| {wall * 1e3:.1f} |"
        )
    _configure(model, "none", device)
    return "\n".join(lines)


def synchronising_calls(model, seq_len: int, device: torch.device) -> str:
    """Synchronising CUDA calls in steps 2 and 3 of each mode, counted from the warnings
    torch.cuda.set_sync_debug_mode("warn") emits. Offloading must add none."""
    if device.type != "cuda":
        return "skipped: torch.cuda.set_sync_debug_mode needs a CUDA device"
    ids = random_ids(model, 1, seq_len, device)
    lines = ["| mode | synchronising calls per step | first one |", "|---|---|---|"]
    for mode in ("none", "hf_offload", "checkpointing", "checkpointing+hf_offload", "checkpointing+hf_offload_auto"):
        _configure(model, mode, device)
        for _ in range(2):  # warm-up: the pool's pinned buffers, the budget's measuring step
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(2):
                    model(input_ids=ids, labels=ids).loss.backward()
                    model.zero_grad(set_to_none=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        calls = [w for w in caught if "synchroniz" in str(w.message)]
        first = f"{Path(calls[0].filename).name}:{calls[0].lineno}" if calls else "-"
        lines.append(f"| {mode} | {len(calls) / 2:g} | {first} |")
    _configure(model, "none", device)
    return "\n".join(lines)


def run_tests(device: torch.device) -> int:
    if device.type != "cuda":
        print("GPU tests: skipped (no CUDA device)")
        return 0
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    gpu_tests = [str(TESTS / "test_gpu.py"), str(TESTS / "test_bench_max_seq.py"), "-m", "gpu"]
    print("\n== GPU tests ==", flush=True)
    plain = subprocess.run([*command, *gpu_tests], timeout=300)
    print("\n== parity under TORCH_CUDA_SANITIZER=1 ==", flush=True)
    sanitizer = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    sanitized = subprocess.run([*command, str(TESTS / "test_gpu.py"), "-k", "parity"], env=sanitizer, timeout=300)
    return plain.returncode or sanitized.returncode


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 4096 16384 (CPU smoke: 64 128)")
    parser.add_argument("--lora-seq-len", type=int, default=None, help="the LoRA rows' length (default 8192)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every stage on the CPU (tiny model)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, dtype, preset = torch.device("cpu"), torch.float32, "tiny"
        seq_lens, lora_seq_len = args.seq_lens or [64, 128], args.lora_seq_len or 64
        memory_limit = 2**30  # the budget modes' figure on the CPU (the byte accounting's limit)
    elif torch.cuda.is_available():
        device, dtype, preset = torch.device("cuda"), torch.bfloat16, "1b"
        seq_lens, lora_seq_len = args.seq_lens or [4096, 16384], args.lora_seq_len or 8192
        memory_limit = None
    else:
        print("no CUDA device: the GPU check needs one (--cpu-smoke checks the script on the CPU)")
        return 2
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run (tiny preset, simulated copies)"
    print(f"date: {datetime.date.today().isoformat()}")
    print(f"device: {where}, torch {torch.__version__}, CUDA {torch.version.cuda}, hf_offload {hf_offload.__version__}")
    print(f"packages: {package_versions()}; preset {preset}, random weights, {str(dtype)[6:]}, batch 1")

    def stage(title: str) -> None:
        print(f"\n== {title} ({time.perf_counter() - started:.0f} s in) ==", flush=True)

    model = build_model(preset, None, device, dtype)
    common = dict(batch_size=1, steps=args.steps, device=device, memory_limit=memory_limit, progress=False)

    stage("1. full fine-tuning sweep")
    records: list[Record] = []
    for record in sweep(model, modes=args.modes, seq_lens=seq_lens, **common):
        records.append(record)
        print(f"  {record.mode:<30} seq {record.seq_len:>6}: {record.status}", flush=True)
    # The simulator's peak beside each measured one: every GPU run also checks `hf-offload estimate`.
    annotate(records, simulator_for(model, device=device))
    print()
    print(markdown_table(records, device=device))
    print()
    print(ratios_table(records, seq_lens))
    print()
    print(budget_table(records, seq_lens))

    stage("2. CPU issue time against GPU time")
    print(issue_against_gpu_time(model, seq_lens[0], device))
    stage("3. synchronising calls")
    print(synchronising_calls(model, seq_lens[0], device))

    stage(f"4. LoRA r=16 on every linear layer, {lora_seq_len} tokens")
    lora_model = _lora(model)
    lora_modes = [mode for mode in LORA_MODES if mode in args.modes]
    lora_records = list(sweep(lora_model, modes=lora_modes, seq_lens=[lora_seq_len], **common))
    annotate(lora_records, simulator_for(lora_model, device=device))
    print(markdown_table(lora_records, device=device))
    print()
    print(ratios_table(lora_records, [lora_seq_len]))
    print()
    print(budget_table(lora_records, [lora_seq_len]))
    del lora_model, model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    status = 0
    if not args.skip_tests:
        stage("5. GPU tests")
        status = run_tests(device)
    stage(f"done, exit status {status}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
