"""The longest sequence whose simulated step fits a device: a bisection on a grid of tokens,
started from a bracket that two simulations predict.

Every allocation of a step grows linearly with the sequence (SDPA keeps nothing quadratic), so
when two steps at different lengths run the same ops, the bytes live during op i are
`a_i + b_i x tokens` exactly, and the peak at any length is the largest of those lines. That
predicts the longest length; the bisection then simulates the grid points around it until one
fits and the next does not (more if the prediction was off: tiling runs more ops at longer
lengths, so only the peak's own line predicts it, and hf_offload's host budget or
`min_offload_bytes` bend the lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .step import StepResult

# Longer than any device's memory allows for a model worth simulating; the search stops there.
LONGEST = 1 << 24
# A prediction beyond this many times the longest length simulated is approached in leaps of that
# size: a step's cost grows with its length (a tiled one's), and a far prediction is a poor one.
LEAP = 16


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
    reached_limit: bool = False  # the search stopped at `limit`: memory allows at least max_seq_len
    limit: int = LONGEST  # the longest length searched: LONGEST, or what the model can run (its positions)


# A tiled search starts at this many slices of the layers' tile: there a slice's own bytes are a
# small constant beside what grows with the sequence, and the peak's line through two lengths holds.
TILED_SEARCH_SLICES = 16


def search_lengths(config, training, mode: str, seq_len: int) -> tuple[int, int]:
    """The two lengths a search of `mode` starts from: `seq_len` and twice it; for a tiled mode
    at least TILED_SEARCH_SLICES slices (its steps run different ops at different lengths, so
    only the peak's line predicts, and it holds once the layers dominate the peak)."""
    if "+tiled" in mode:
        tile = training.tile_tokens or config.get_text_config().hidden_size
        seq_len = max(seq_len, TILED_SEARCH_SLICES * tile)
    return seq_len, 2 * seq_len


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
        # Not the same ops (tiling runs more slices at longer lengths): the peak's own line, and one
        # per phase and module present at both lengths (a peak that is constant at short lengths,
        # the optimizer's, does not hide a layer's that grows).
        lines = [(short.tracked_peak_bytes, (long_.tracked_peak_bytes - short.tracked_peak_bytes) / span)]
        common = [tag for tag in short.tag_peaks if tag in long_.tag_peaks]
        lines += [(short.tag_peaks[tag], (long_.tag_peaks[tag] - short.tag_peaks[tag]) / span) for tag in common]
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
    stored: Callable[[StepResult], bool] | None = None,
    storable: Callable[[StepResult, StepResult], int | None] | None = None,
    run_together: Callable[[list[tuple[int, bool]]], list[StepResult]] | None = None,
    limit: int = LONGEST,
) -> LongestSequence:
    """`run(seq_len, trace)` simulates one step. The answer is a multiple of `granularity` that
    fits, with the next multiple simulated and not fitting (or LONGEST reached).

    After the two lengths' prediction, each next length is where the line through the two steps
    nearest the edge (one that fits and one that does not, once there are both) reaches the
    memory, rounded down to the grid; where the line is exact, as for a step whose peak grows
    linearly, the prediction fits and the next grid point does not: two steps. Where it is not
    (the lines bend), a step that fails to halve the bracket makes the next one a bisection.

    With host and disk tiers, a step fits when its peak does and `stored(step)` (its offloaded
    bytes fit host memory and disk); `storable(short, long)` predicts from the first two steps the
    longest length the tiers hold, and no aim goes past it.

    `run_together(tasks)`, where given, simulates several `(seq_len, trace)` at once (in parallel
    processes): the first two lengths, the prediction with the grid point after it (the two steps
    that end the search when the prediction holds), and where the search bisects, the bracket's
    two thirds.

    `limit` is the longest length the model can run at all (a table of positions, GPT-2's
    `n_positions`): no step is simulated past it, and a search that reaches it stops there
    (`reached_limit`, with `limit` kept on the result)."""
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    if not granularity <= limit <= LONGEST:
        raise ValueError(f"limit must be within [granularity={granularity}, {LONGEST}], got {limit}")
    if max(lengths) > limit:
        raise ValueError(f"the search's first lengths {lengths} must be within its limit of {limit} tokens")
    result = LongestSequence(mode=mode, memory_bytes=memory_bytes, granularity=granularity, limit=limit)
    results: dict[int, StepResult] = {}
    grid = granularity
    top = limit // grid * grid

    def ok(step: StepResult) -> bool:
        return step.peak_bytes <= memory_bytes and (stored is None or stored(step))

    def record(seq_len: int, step: StepResult) -> None:
        results[seq_len] = step
        result.probes.append(Probe(seq_len, step.peak_bytes, ok(step), step.host_bytes))

    def fits(seq_len: int, trace: bool = False) -> bool:
        if seq_len not in results or (trace and results[seq_len].trace is None):
            record(seq_len, run(seq_len, trace))
        return ok(results[seq_len])

    def together(tasks: list[tuple[int, bool]]) -> None:
        todo = [(n, trace) for n, trace in tasks if n not in results or (trace and results[n].trace is None)]
        if run_together is not None and len(todo) > 1:
            for (seq_len, _trace), step in zip(todo, run_together(todo), strict=True):
                record(seq_len, step)

    def bracket() -> tuple[int | None, int | None]:
        """The smallest grid point simulated not to fit, and the largest below it that fits."""
        on_grid = [n for n in results if n % grid == 0]
        high = min((n for n in on_grid if not ok(results[n])), default=None)
        low = max((n for n in on_grid if ok(results[n]) and (high is None or n < high)), default=None)
        return low, high

    def secant() -> float | None:
        """Where the line through the two steps nearest the edge reaches the memory."""
        fitting = sorted(n for n in results if ok(results[n]))
        failing = sorted(n for n in results if not ok(results[n]))
        if fitting and failing:
            a, b = fitting[-1], failing[0]
        elif len(fitting) >= 2:
            a, b = fitting[-2], fitting[-1]
        elif len(failing) >= 2:
            a, b = failing[0], failing[1]
        else:
            return None
        pa, pb = results[a].peak_bytes, results[b].peak_bytes
        if pb == pa or a == b:
            return None
        return a + (memory_bytes - pa) * (b - a) / (pb - pa)

    first, second = lengths
    together([(first, True), (second, True)])
    fits(first, trace=True)
    fits(second, trace=True)
    predicted = predict_longest(results[first], results[second], memory_bytes - workspace_bytes)
    ceiling = None if storable is None else storable(results[first], results[second])
    if predicted is not None and ceiling is not None:
        predicted = min(predicted, ceiling)  # the device's lines know nothing of the tiers' edge
    result.predicted = predicted
    aim: float | None = predicted
    width = None
    while True:
        low, high = bracket()
        if high is not None and (high - (low or 0)) <= grid:
            break  # the edge: low fits (or nothing does), high does not
        if low is not None and low >= top:
            result.reached_limit = True
            break
        span = None if low is None or high is None else high - low
        bisecting = False
        if aim is None:
            aim = secant()
            if aim is not None and ceiling is not None:
                aim = min(aim, ceiling)
            if span is not None and width is not None and span > width / 2:
                aim, bisecting = (low + high) / 2, True  # the line was off: bisect
        if aim is None:  # flat or unknown: double up, or halve down
            aim = 2 * (low or grid) if high is None else ((low or 0) + high) / 2
            bisecting = high is not None
        if bisecting and run_together is not None:
            # Two steps at once cut the bracket in three: its thirds, on the grid, strictly inside.
            lower = low or 0
            thirds = sorted({
                min(max((lower + (high - lower) * k // 3) // grid * grid, lower + grid), high - grid) for k in (1, 2)
            })  # fmt: skip
            if len(thirds) == 2 and not any(n in results for n in thirds):
                width, aim = span, None
                together([(n, False) for n in thirds])
                continue
        if high is None:  # no step has failed yet: leap at most LEAP times the longest simulated
            aim = min(aim, LEAP * max(results))
        candidate = max(int(aim) // grid * grid, grid)
        aim = None
        lower = low if low is not None else 0
        upper = high if high is not None else top + grid
        candidate = min(max(candidate, lower + grid), upper - grid)
        if candidate > top:
            result.reached_limit = low is not None
            break
        width = span
        if predicted is not None and len(results) == 2 and candidate + grid < upper and candidate + grid <= top:
            together([(candidate, False), (candidate + grid, False)])  # the prediction, and the point past it
        fits(candidate)
    low, _high = bracket()
    if low is None:
        return result  # not even one grid step fits
    result.max_seq_len = low
    result.at_max = results[low]
    return result
