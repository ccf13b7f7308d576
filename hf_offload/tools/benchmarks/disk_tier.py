"""The disk tier, measured on this machine's disk (issue 25, item 4):

    python -m hf_offload.tools.benchmarks.disk_tier [--dir DIR] [--mib 1024] [--tensor-mib 64]

1. Throughput: the tier's own writer and reader (`hf_offload.engine.disk.DiskStore`, the code
   training runs) write `--mib` MiB as tensors of `--tensor-mib` MiB from pooled host buffers and
   read them back, against `dd` with direct I/O on the same directory in the same run (the plain
   baseline: one sequential stream of the same chunk size from /dev/zero, to /dev/null). Target:
   the tier at >= 0.8x the baseline both ways. The bytes read back are checked against those
   written.
2. Step time: a training step on the CPU path (`simulate_on_cpu`) of a small Llama-shaped model
   with checkpointing at a length where attention's compute dwarfs a layer's input, with every
   offloaded layer's input in host memory against most of them on disk (`disk_dir`, a host budget
   of three layers, two of them for staging): the ratio, and the seconds the step waited on the disk.

Files are written under --dir (default: a new directory in the system's temporary directory) and
removed at the end. The figures go to docs/tiers.md with the date, machine and versions printed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hf_offload.engine.disk import DiskStore
from hf_offload.engine.pool import HostPool, rounded_size
from hf_offload.engine.streams import SimulatedStreams


class _Context:
    """What the store needs of a device context: streams, and a pool (with no host budget)."""

    def __init__(self) -> None:
        self.streams = SimulatedStreams()
        self.pool = HostPool(self.streams)


class _Tensor:
    """What the store needs of a copy: its staging buffer and where it is on disk."""

    __slots__ = ("host_block", "host_size", "disk_offset", "job", "read_error", "__weakref__")

    def __init__(self, host_size: int) -> None:
        self.host_block = None
        self.host_size = host_size
        self.disk_offset = None
        self.job = None
        self.read_error = None


def tier_throughput(directory: str, total: int, tensor: int) -> tuple[float, float, bool]:
    """GB/s writing then reading `total` bytes as tensors of `tensor` bytes, and whether every
    byte came back."""
    context = _Context()
    store = DiskStore(directory, 2**62)
    size = rounded_size(tensor)
    count = max(1, total // size)
    tensors = [_Tensor(size) for _ in range(count)]
    for index, each in enumerate(tensors):
        each.host_block = context.pool.acquire(size)
        each.host_block.view(size).fill_(index % 251)
    marks = [(each.host_block.view(size)[:: 1 << 20].clone()) for each in tensors]
    event = context.streams.record(context.streams.copy_stream)
    started = time.perf_counter()
    for each in tensors:
        store.write(each, context, event)
    for each in tensors:
        if each.job is not None:  # settled already by an earlier wait
            store.wait(each.job)
    write_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for each in tensors:
        store.read(each, context, needed_now=True)
    for each in tensors:
        if each.job is not None:  # settled already by an earlier wait
            store.wait(each.job)
    read_seconds = time.perf_counter() - started
    intact = all(
        torch.equal(each.host_block.view(size)[:: 1 << 20], mark) for each, mark in zip(tensors, marks, strict=True)
    )
    mode = store.mode
    for each in tensors:
        context.pool.release(each.host_block)
        store.release(each.disk_offset, size)
    store.close()
    nbytes = count * size
    print(f"tier ({mode}, {count} tensors of {size / 2**20:.0f} MiB): write {nbytes / write_seconds / 1e9:.2f} GB/s, "
          f"read {nbytes / read_seconds / 1e9:.2f} GB/s, bytes intact: {intact}")
    return nbytes / write_seconds / 1e9, nbytes / read_seconds / 1e9, intact


def dd_throughput(directory: str, total: int, chunk: int) -> tuple[float | None, float | None]:
    """GB/s of dd with direct I/O: /dev/zero to a file, the file to /dev/null."""
    if shutil.which("dd") is None:
        print("dd: not found")
        return None, None
    path = os.path.join(directory, "dd-baseline")
    count = max(1, total // chunk)
    rates = []
    try:
        for arguments in (
            ["if=/dev/zero", f"of={path}", "oflag=direct"],
            [f"if={path}", "of=/dev/null", "iflag=direct"],
        ):
            started = time.perf_counter()
            done = subprocess.run(
                ["dd", *arguments, f"bs={chunk}", f"count={count}"], capture_output=True, text=True, timeout=600
            )
            seconds = time.perf_counter() - started
            if done.returncode != 0:
                print(f"dd {' '.join(arguments)}: failed: {done.stderr.strip()}")
                rates.append(None)
            else:
                rates.append(count * chunk / seconds / 1e9)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"dd (direct I/O, bs={chunk // 2**20} MiB): write {_gbps(rates[0])}, read {_gbps(rates[1])}")
    return rates[0], rates[1]


def _gbps(rate: float | None) -> str:
    return "failed" if rate is None else f"{rate:.2f} GB/s"


def step_times(directory: str, tokens: int, steps: int) -> None:
    """Median step seconds with every layer input in host memory and with most on disk."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_offload

    config = AutoConfig.for_model(
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=tokens,
    )
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    layer_input = rounded_size(tokens * config.hidden_size * 4)
    results = {}
    for name, options in (
        ("host only", {}),
        ("disk tier", {"disk_dir": directory, "max_host_bytes": 3 * layer_input}),
    ):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.train()
        model.activation_checkpointing_enable()
        hf_offload.enable_activation_offloading(model, simulate_on_cpu=True, **options)
        seconds = []
        for step in range(steps + 1):
            started = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            if step:  # the first step measures and plans
                seconds.append(time.perf_counter() - started)
        results[name] = (statistics.median(seconds), model.activation_offloading_stats())
        model.disable_activation_offloading()
    (host, _), (disk, stats) = results["host only"], results["disk tier"]
    print(
        f"\nstep time at {tokens} tokens (8 layers, hidden 256, checkpointing, fp32, CPU path), median of {steps}:"
    )
    print("| host only s | disk tier s | disk / host | layers on disk | written | read | waited on disk s |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {host:.2f} | {disk:.2f} | {disk / host:.3f}x | {stats.layers_on_disk} of 7 | "
        f"{stats.disk_bytes_written / 2**20:.0f} MiB | {stats.disk_bytes_read / 2**20:.0f} MiB | "
        f"{stats.disk_wait_seconds:.3f} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    parser.add_argument("--mib", type=int, default=1024, help="MiB written and read by each measurement")
    parser.add_argument("--tensor-mib", type=int, default=64, help="MiB per tensor (and dd's block size)")
    parser.add_argument("--tokens", type=int, default=4096, help="the step-time measurement's sequence length")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-steps", action="store_true", help="throughput only")
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="hf_offload-disk-bench-", dir=args.dir)
    try:
        print(f"date: {datetime.date.today().isoformat()}")
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}; "
            f"python {platform.python_version()}, torch {torch.__version__}"
        )
        device = subprocess.run(["df", "-hT", directory], capture_output=True, text=True).stdout.splitlines()[-1:]
        print(f"directory: {directory} ({' '.join(device[0].split()[:2]) if device else 'unknown file system'})\n")
        total, chunk = args.mib * 2**20, args.tensor_mib * 2**20
        rounds = []
        for _ in range(2):  # twice, alternating, so that neither has the disk's warm-up to itself
            baseline = dd_throughput(directory, total, chunk)
            tier = tier_throughput(directory, total, chunk)
            rounds.append((baseline, tier))
        print("\n| | write GB/s | read GB/s |\n|---|---|---|")
        best = {}
        for name, pick in (("dd, direct I/O", 0), ("hf_offload disk tier", 1)):
            writes = [r[pick][0] for r in rounds if r[pick][0] is not None]
            reads = [r[pick][1] for r in rounds if r[pick][1] is not None]
            best[name] = (max(writes, default=None), max(reads, default=None))
            print(f"| {name} | {_gbps(best[name][0])} | {_gbps(best[name][1])} |")
        (dd_write, dd_read), (tier_write, tier_read) = best["dd, direct I/O"], best["hf_offload disk tier"]
        if dd_write and dd_read:
            ratios = (tier_write / dd_write, tier_read / dd_read)
            verdict = "met" if min(ratios) >= 0.8 else "MISSED"
            print(f"| tier / dd | {ratios[0]:.2f}x | {ratios[1]:.2f}x |  target >= 0.8x: {verdict}")
        intact = all(r[1][2] for r in rounds)
        print(f"bytes read back equal those written: {intact}")
        if not args.skip_steps:
            step_times(directory, args.tokens, args.steps)
        return 0 if intact else 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
