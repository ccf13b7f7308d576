"""The longest sequence whose simulated step fits a device: a bisection on a grid of tokens,
started from a bracket that two simulations predict.

Every allocation of a step grows linearly with the sequence (SDPA keeps nothing quadratic), so
when two steps at different lengths run the same ops, the bytes live during op i are
`a_i + b_i x tokens` exactly, and the peak at any length is the largest of those lines. That
predicts the longest length; the bisection then simulates the grid points around it until one
fits and the next does not (more if the prediction was off: tiling runs more ops at longer
lengths, and hf_offload's host budget or `min_offload_bytes` bend the lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .step import StepResult

# Longer than any device's memory allows for a model worth simulating; the search stops there.
LONGEST = 1 << 24


@dataclass
class Probe:
    seq_len: int
    peak_bytes: int
    fits: bool
    host_bytes: int | None = None


@dataclass
class LongestSequence:
    mode: str
    memory_bytes: int
    granularity: int
    max_seq_len: int | None = None  # None: not even one grid step fits
    predicted: int | None = None  # what the two lines predicted
    at_max: StepResult | None = None
    probes: list[Probe] = field(default_factory=list)
    reached_limit: bool = False


def predict_longest(first: StepResult, second: StepResult, budget: int) -> int | None:
    """The most tokens per sequence whose peak stays within `budget` (bytes for the tracked ops),
    from two steps of the same mode at two lengths; None when no length fits, LONGEST when memory
    does not grow."""
    (short, long_) = sorted((first, second), key=lambda r: r.seq_len)
    span = long_.seq_len - short.seq_len
    if span <= 0:
        raise ValueError("two different lengths are needed")
    if short.trace is not None and long_.trace is not None and len(short.trace) == len(long_.trace):
        lines = [(a, (b - a) / span) for a, b in zip(short.trace, long_.trace, strict=True)]
    else:
        lines = [(short.tracked_peak_bytes, (long_.tracked_peak_bytes - short.tracked_peak_bytes) / span)]
    longest = float(LONGEST)
    for at_short, slope in lines:
        # bytes at length n: at_short + slope * (n - short.seq_len)
        if slope <= 0:
            if at_short > budget:
                return None
            continue
        longest = min(longest, short.seq_len + (budget - at_short) / slope)
    return None if longest < 1 else int(longest)


def longest_sequence(
    run: Callable[[int, bool], StepResult],
    *,
    mode: str,
    memory_bytes: int,
    workspace_bytes: int,
    granularity: int = 1024,
    lengths: tuple[int, int] = (8192, 16384),
) -> LongestSequence:
    """`run(seq_len, trace)` simulates one step. The answer is a multiple of `granularity` that
    fits, with the next multiple simulated and not fitting (or LONGEST reached)."""
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    result = LongestSequence(mode=mode, memory_bytes=memory_bytes, granularity=granularity)
    results: dict[int, StepResult] = {}

    def fits(seq_len: int, trace: bool = False) -> bool:
        if seq_len not in results or (trace and results[seq_len].trace is None):
            step = run(seq_len, trace)
            results[seq_len] = step
            ok = step.peak_bytes <= memory_bytes
            result.probes.append(Probe(seq_len, step.peak_bytes, ok, step.host_bytes))
        return results[seq_len].peak_bytes <= memory_bytes

    first, second = lengths
    fits(first, trace=True)
    fits(second, trace=True)
    predicted = predict_longest(results[first], results[second], memory_bytes - workspace_bytes)
    result.predicted = predicted
    grid = granularity
    guess = max((predicted or 0) // grid * grid, grid)
    guess = min(guess, LONGEST // grid * grid)
    # A bracket [low, high): low fits, high does not (or is past LONGEST).
    low = high = None
    if fits(guess):
        low, step = guess, grid
        while True:
            candidate = low + step
            if candidate > LONGEST:
                result.reached_limit = True
                break
            if fits(candidate):
                low, step = candidate, step * 2
            else:
                high = candidate
                break
    else:
        high, step = guess, grid
        while True:
            candidate = high - step
            if candidate < grid:
                break
            if fits(candidate):
                low = candidate
                break
            high, step = candidate, step * 2
    if low is None:
        return result  # not even one grid step fits
    while high is not None and high - low > grid:
        middle = (low + high) // 2 // grid * grid
        if fits(middle):
            low = middle
        else:
            high = middle
    result.max_seq_len = low
    result.at_max = results[low]
    return result
