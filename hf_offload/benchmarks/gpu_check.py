"""The GPU check: one command that measures what the package claims on a real accelerator.

    python -m hf_offload.benchmarks.gpu_check [--seq-lens 4096 16384] [--steps 3]

For a Llama-shaped model of about 1.2B parameters (Llama-3.2-1B's shape, random weights, bf16,
batch 1) at each sequence length it prints the peak device memory and the step time
(forward + backward) of: no offloading; hf_offload; TRL's OffloadActivations (when trl is
importable); activation checkpointing alone; transformers' checkpointing with offload=True;
and checkpointing + hf_offload, with the ratios the targets are stated in. Then it runs the
GPU tests (parity, peak memory, no growth) and the parity test again under PyTorch's CUDA
stream sanitizer (TORCH_CUDA_SANITIZER=1). Needs no network. Meant to finish within 8 minutes
on one H100/H200-class GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_offload.bench import MODES, build_model, markdown_table, sweep


def ratios_table(records, seq_lens) -> str:
    by_key = {(r.mode, r.seq_len): r for r in records if r.status == "ok"}
    lines = [
        "| seq | mode | peak vs none | time vs none | time vs checkpointing | peak vs trl | time vs trl |",
        "|---|---|---|---|---|---|---|",
    ]

    def ratio(record, base, field):
        if base is None:
            return "-"
        return f"{getattr(record, field) / getattr(base, field):.3f}x"

    for seq_len in seq_lens:
        none, ckpt, trl = (by_key.get((mode, seq_len)) for mode in ("none", "checkpointing", "trl_offload"))
        for mode in MODES:
            record = by_key.get((mode, seq_len))
            if record is None:
                continue
            lines.append(
                f"| {seq_len} | {mode} | {ratio(record, none, 'peak_device_bytes')} "
                f"| {ratio(record, none, 'step_seconds')} | {ratio(record, ckpt, 'step_seconds')} "
                f"| {ratio(record, trl, 'peak_device_bytes')} | {ratio(record, trl, 'step_seconds')} |"
            )
    return "\n".join(lines)


def package_versions() -> str:
    """The versions the figures depend on, as imported (a carried wheel can shadow the system's)."""
    import importlib

    versions = []
    for name in ("transformers", "peft", "trl", "accelerate"):
        try:
            versions.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            versions.append(f"{name} not installed")
    return ", ".join(versions)


def run_tests() -> int:
    tests = Path(__file__).resolve().parents[2] / "tests" / "test_gpu.py"
    if not tests.exists():
        print(f"GPU tests not found at {tests}; skipped")
        return 1
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    print("\n== GPU tests ==", flush=True)
    plain = subprocess.run(command, timeout=300)
    print("\n== parity under TORCH_CUDA_SANITIZER=1 ==", flush=True)
    sanitized = subprocess.run([*command, "-k", "parity"], env=dict(os.environ, TORCH_CUDA_SANITIZER="1"), timeout=300)
    return plain.returncode or sanitized.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one")
        return 2
    device = torch.device("cuda")
    print(f"date: {datetime.date.today().isoformat()}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"packages: {package_versions()}; Llama-3.2-1B shape, random weights, bf16, batch 1")
    model = build_model("1b", None, device, torch.bfloat16)
    records = []
    for record in sweep(
        model, modes=args.modes, seq_lens=args.seq_lens, batch_size=1, steps=args.steps, device=device, progress=False
    ):
        records.append(record)
        print(f"  {record.mode:<26} seq {record.seq_len:>6}: {record.status}", flush=True)
    print()
    print(markdown_table(records, device=device))
    print()
    print(ratios_table(records, args.seq_lens))
    return 0 if args.skip_tests else run_tests()


if __name__ == "__main__":
    raise SystemExit(main())
