"""The GPU check: one command that measures what the package claims on a real accelerator.

    python -m hf_offload.benchmarks.gpu_check [--seq-lens 4096 16384] [--steps 3]

For a Llama-shaped model of about 1.2B parameters (Llama-3.2-1B's shape, random weights, bf16,
batch 1) at each sequence length it prints the peak device memory and the step time
(forward + backward) of: no offloading; hf_offload; TRL's OffloadActivations (when trl is
importable); activation checkpointing alone; transformers' checkpointing with offload=True;
and checkpointing + hf_offload. Then it runs the GPU tests (parity, peak memory, no growth)
and the parity test again under PyTorch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1).
Needs no network. Meant to finish within 8 minutes on one H100/H200-class GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ONE_B_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)

MODES = (
    "none",
    "hf_offload",
    "trl_offload",
    "checkpointing",
    "transformers_offload",
    "checkpointing+hf_offload",
)


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**ONE_B_SHAPE)).to(torch.bfloat16)
    return model.train()


def configure(model, mode):
    """Put the model in `mode`; returns a context factory wrapped around each forward."""
    import hf_offload

    hf_offload.disable_activation_offloading(model)
    model.activation_checkpointing_disable()
    if mode in ("hf_offload", "checkpointing+hf_offload"):
        model.enable_activation_offloading()
    if mode in ("checkpointing", "checkpointing+hf_offload"):
        model.activation_checkpointing_enable()
    if mode == "transformers_offload":
        model.activation_checkpointing_enable(offload=True)
    if mode == "trl_offload":
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        return lambda: get_act_offloading_ctx_manager(model)
    return contextlib.nullcontext


def measure(model, mode, seq_len, steps):
    ids = torch.randint(ONE_B_SHAPE["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    forward_context = configure(model, mode)

    def one_step():
        with forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    one_step()  # warm-up: kernels, allocator, pinned pool
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return torch.cuda.max_memory_allocated(), seconds


def run_benchmarks(seq_lens, steps, modes):
    model = build_model()
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: Llama shape, {parameters / 1e9:.2f}B parameters, bf16, batch 1, {steps} timed steps after 1 warm-up")
    results = {}
    for seq_len in seq_lens:
        for mode in modes:
            gc.collect()
            torch.cuda.empty_cache()
            try:
                peak, seconds = measure(model, mode, seq_len, steps)
                results[seq_len, mode] = (peak, seconds)
                print(
                    f"  seq {seq_len:>6} {mode:<26} peak {peak / 2**30:7.2f} GiB  step {seconds * 1e3:8.1f} ms",
                    flush=True,
                )
            except ImportError as error:
                print(f"  seq {seq_len:>6} {mode:<26} skipped: {error}", flush=True)
            except torch.OutOfMemoryError:
                print(f"  seq {seq_len:>6} {mode:<26} out of memory", flush=True)
            except Exception as error:  # a mode that fails is reported, not fatal
                print(f"  seq {seq_len:>6} {mode:<26} failed: {type(error).__name__}: {error}", flush=True)
        configure(model, "none")
    return results


def print_table(results, seq_lens, modes):
    print()
    print("| seq | mode | peak GiB | step ms | peak vs none | time vs none | time vs checkpointing |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        base = results.get((seq_len, "none"))
        ckpt = results.get((seq_len, "checkpointing"))
        for mode in modes:
            if (seq_len, mode) not in results:
                continue
            peak, seconds = results[seq_len, mode]
            vs_none_peak = f"{peak / base[0]:.2f}x" if base else "-"
            vs_none_time = f"{seconds / base[1]:.2f}x" if base else "-"
            vs_ckpt_time = f"{seconds / ckpt[1]:.3f}x" if ckpt else "-"
            print(
                f"| {seq_len} | {mode} | {peak / 2**30:.2f} | {seconds * 1e3:.1f} | {vs_none_peak} "
                f"| {vs_none_time} | {vs_ckpt_time} |"
            )


def run_tests():
    tests = Path(__file__).resolve().parents[2] / "tests" / "test_gpu.py"
    if not tests.exists():
        print(f"GPU tests not found at {tests}; skipped")
        return 1
    print("\n== GPU tests ==", flush=True)
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)], timeout=300)
    print("\n== parity under TORCH_CUDA_SANITIZER=1 ==", flush=True)
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    sanitized = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "-k", "parity"],
        env=env,
        timeout=300,
    )
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
    print(f"date: {datetime.date.today().isoformat()}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    import transformers

    print(f"transformers {transformers.__version__}")
    results = run_benchmarks(args.seq_lens, args.steps, args.modes)
    print_table(results, args.seq_lens, args.modes)
    return 0 if args.skip_tests else run_tests()


if __name__ == "__main__":
    raise SystemExit(main())
