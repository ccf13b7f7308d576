"""What the CPU allocator held while a function ran, from torch's profiler: the CPU's measured
memory figure (the simulator's is checked against it, and docs/peft.md's QLoRA recipes use it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    # Tiny ops on a loaded 2-core machine run many times faster without intra-op threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def peak_allocated(fn: Callable[[], object], ignore_bytes: int | None = None) -> tuple[int, list[str]]:
    """The most bytes the CPU allocator held at once while `fn` ran, beyond what was allocated
    before, and the ops running at that moment, innermost first. Every allocation and free is
    reported by torch's profiler with its size, so this is exact (allocations of exactly
    `ignore_bytes` left out)."""
    with one_thread(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    live = peak = 0
    at = None
    memory = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and abs(e.nbytes()) != ignore_bytes]
    for start, nbytes in sorted(memory):
        live += nbytes
        if live > peak:
            peak, at = live, start
    running = [e for e in events if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns()]
    return peak, [e.name() for e in sorted(running, key=lambda e: e.end_ns() - e.start_ns())]
