"""Measure the fixed cost of offloading one saved tensor, to choose `min_offload_bytes`.

    python -m hf_offload.tools.benchmarks.min_offload_bytes [--link-gbps 25]

Times one pack and one restore through the real engine (CPU simulation) for tensors of
growing size, takes the smallest size's time as the fixed cost per tensor, and reports the
size at which the fixed cost equals the time the bytes take over a host link of the given
bandwidth. Below that size a tensor costs more in
bookkeeping than in transfer, while holding a negligible share of a layer's activations.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_offload.engine import ActivationOffloader

TENSORS_PER_LAYER = 16  # a decoder layer offloads 10-40 tensors; per-layer costs are shared


def time_offload(nbytes: int, repeats: int) -> float:
    """Median seconds per tensor to offload a layer's saved tensors and restore them: the pack
    decisions and handles, the queued batch of copies out and its release, and the copies
    back, through the real engine's code (CPU simulation, so the copies are plain memcpy)."""
    engine = ActivationOffloader(min_offload_bytes=0, simulate_on_cpu=True)
    cpu = torch.device("cpu")
    samples = []
    for _ in range(repeats):
        tensors = [torch.randn(max(nbytes // 4, 1)) for _ in range(TENSORS_PER_LAYER)]
        start = time.perf_counter()
        group = engine.enter_layer(
            training=True, device=cpu, starts_pass=True, keep=False, protected=tuple, pass_protected=tuple
        )
        handles = [group.pack(tensor) for tensor in tensors]
        engine.exit_layer(group, "benchmark")
        context = group.device
        engine.release_in_flight()
        context.restore_async(group.copies)
        for handle in handles:
            handle.restore()
        samples.append((time.perf_counter() - start) / TENSORS_PER_LAYER)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=25.0, help="host link bandwidth, GB/s (PCIe 4 x16 ~25)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [4, 1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    print(f"{'bytes':>10}  {'offload+restore, us':>20}")
    time_offload(sizes[0], args.repeats)  # warm-up: imports, allocator, first-call paths
    timings = []
    for nbytes in sizes:
        seconds = time_offload(nbytes, args.repeats)
        timings.append(seconds)
        print(f"{nbytes:>10}  {seconds * 1e6:>20.1f}")
    fixed = timings[0]
    break_even = fixed * args.link_gbps * 1e9
    print(f"fixed cost per tensor: {fixed * 1e6:.1f} us (smallest size)")
    print(f"bytes moved over a {args.link_gbps:g} GB/s link in that time: {break_even / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
