"""`hf-offload estimate`: what a training step needs on the device and the host, and how long it
takes, from a simulation of the real step on the meta device (`hf_offload.tools.simulator`).

For each mode: the peak of allocated device bytes (what `torch.cuda.max_memory_allocated`
reports) and where it falls (the op, the module, what is live by origin); the host bytes
hf_offload's pool needs and the bytes it moves per step; the FLOPs; a step time from the device's
rates; per offloaded layer, whether its copies hide behind its compute; and with a device memory,
the longest sequence that fits, by bisection. With a disk tier (`Training.disk_memory_bytes`):
where each layer's offloaded inputs live, the host and disk bytes they need, and whether the
disk's time hides behind compute (`simulator.tiers`); the longest sequence then also needs host
memory and disk to hold the step.

This module computes: `run_estimate` returns one `Estimate` holding every figure the answer shows;
`estimate_report` makes the text and the JSON from it, and only formats.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from hf_offload.tools.decode_time import rates
from hf_offload.tools.devices import (
    Device,
    compute_seconds,
)
from hf_offload.tools.estimate_report import size
from hf_offload.tools.generation_limits import check_generation, model_positions, vllm_range
from hf_offload.tools.grpo_generation import (
    VLLM_ASSUMPTIONS,
    VLLM_MAX_NUM_BATCHED_TOKENS,
    CycleTime,
    GenerationPlan,
    cycle_time,
    hold_generation,
    vllm_share,
)
from hf_offload.tools.modes import parse_mode
from hf_offload.tools.reserve import Reserve, device_reserve
from hf_offload.tools.simulator import PositionTable, Simulator, StepResult, Training, composition
from hf_offload.tools.simulator.generation import DECODE_STEPS
from hf_offload.tools.simulator.linear_attention import STAND_INS, uses_linear_attention
from hf_offload.tools.simulator.search import LONGEST, LongestSequence, Probe, longest_sequence, search_lengths
from hf_offload.tools.simulator.tiers import (
    DEFAULT_DISK_GBPS,
    DiskTime,
    disk_time,
    layer_places,
    longest_stored,
    stored,
)
from hf_offload.tools.step_time import FLASH_ATTENTION_2, StepTime, attention_slowdown, step_time

GIB = 2**30


@dataclass
class Request:
    config: object
    name: str  # how the model is named in the output
    training: Training
    modes: list[str]
    seq_len: int = 8192
    memory_bytes: int | None = None  # for the longest sequence
    granularity: int = 1024
    tflops: float | None = None
    link_gbps: float | None = None
    efficiency: float | None = None
    disk_gbps: float | None = None  # the disk tier's rate (None: DEFAULT_DISK_GBPS)
    seq_len_given: bool = True  # False: the default length, which a model's position table may cap
    # The reserve the longest sequence leaves free (`tools/reserve.py`): items replaced by name, in
    # bytes (None: every item's default); `reserve_bytes` is what `run_estimate` found in all.
    reserve: dict[str, int] | None = None
    reserve_bytes: int = 0
    # Where `training.host_memory_bytes` (the host RAM per rank) comes from: "device" (the device
    # preset's machine), "given" (--host-memory), or None (unlimited).
    host_from: str | None = None

    @property
    def disk_rate(self) -> float:
        return DEFAULT_DISK_GBPS if self.disk_gbps is None else self.disk_gbps

    @property
    def usable_bytes(self) -> int | None:
        """The device memory the answer may use: the memory less the reserve, for the step and for
        generation alike (None: no memory given)."""
        return None if self.memory_bytes is None else self.memory_bytes - self.reserve_bytes

    @property
    def link_rate(self) -> float:
        """The host link's GB/s per direction: --link-gbps, else the device preset's."""
        return self.link_gbps or self.training.device.link_gbps


@dataclass
class ModeEstimate:
    mode: str
    step: StepResult
    step_seconds: float
    longest: LongestSequence | None = None
    bytes_per_token: float | None = None  # the peak's slope between the search's two lengths
    sp_seconds: float = 0.0  # Ulysses's all-to-alls, in step_seconds (they wait on each other)
    time: StepTime | None = None  # step_seconds by part, and with another attention kernel
    # GRPO: generation beside the step (`grpo_generation`). `longest` is then the longest completion
    # both fit, its `at_max` the step there; `step_longest` the step's own search (under what
    # generation keeps on the GPU during it).
    generation: GenerationPlan | None = None
    step_longest: LongestSequence | None = None
    generation_longest: int | None = None  # the longest completion generation allows
    generation_reason: str = ""  # what sets it
    cycle: CycleTime | None = None  # one generation batch's seconds, at the answer (else at seq_len)
    cycle_length: int | None = None
    shortest: StepResult | None = None  # where no length fits: the shortest step simulated, to say why
    # GRPO: the step was simulated only at generation's limit (it fits there; its own limit lies beyond,
    # not searched), or not at all (generation fits at no length).
    step_capped: bool = False
    # What the report shows, computed here (the report only formats): the peak's parts by origin
    # (`composition`), the lines that put a model in this mode (`recipe`), the step's seconds with
    # FlashAttention 2 where they differ, decoder layer 0's forward and backward seconds (beside its
    # copies), where the step's and the answer's offloaded inputs live with the disk's time
    # (`tier_estimate`), and where no length fits, why (`NoneFits`).
    peak_parts: list = field(default_factory=list)
    recipe: list[str] = field(default_factory=list)
    flash_attention_2_seconds: float | None = None
    layer_seconds: tuple[float, float] | None = None
    tiers: tuple[list[str], DiskTime | None] | None = None
    tiers_at_max: tuple[list[str], DiskTime | None] | None = None
    none_fits: NoneFits | None = None
    # GRPO: the length generation's figures are at (the answer, else the cycle's), generation's peak
    # there on this GPU, and with the vLLM server the KV cache its GPUs hold there.
    generation_seq_len: int | None = None
    generation_peak_bytes: int | None = None
    server_kv_bytes: int | None = None


@dataclass(frozen=True)
class NoneFits:
    """Where the step fits at no length: the shortest step simulated, the memory it had, what no
    length changes at its peak (weights, reference model, optimizer state, gradients), the floor no
    length goes under, and what colocated vLLM keeps during the step, in words."""

    step: StepResult
    usable_bytes: int
    fixed: dict[str, int]
    floor_bytes: int
    vllm_during_step: str | None = None


class HostNeeds(NamedTuple):
    """At the answer: hf_offload's pool per rank, ZeRO-3's host bytes per node, the two together per
    node, and the ranks on one node."""

    pool: int
    zero3: int
    total: int
    ranks_per_node: int


@dataclass
class Estimate:
    request: Request
    modes: list[ModeEstimate] = field(default_factory=list)
    seconds: float = 0.0
    # Where host memory alone ends the longest mode early: that mode with a disk tier (`past_the_host`).
    with_disk: tuple[Request, ModeEstimate] | None = None
    positions: PositionTable | None = None  # the model's table of positions, which caps every length
    notes: list[str] = field(default_factory=list)  # what the estimate changed in the request, and why
    reserve: Reserve | None = None  # what the longest sequence leaves free (with a device memory)
    host: HostPlan | None = None  # the host RAM per rank and what ZeRO-3 takes of it
    # What the report shows, computed here: the mode that trains the longest and what the host
    # needs there; the model's position table described; the search's last length; the decode steps
    # generation simulates; vLLM's releases and assumptions; TRL's version; FlashAttention 2's
    # slowdown of attention on this device; a hybrid's kernels that stand in on meta.
    best: ModeEstimate | None = None
    host_needs: HostNeeds | None = None
    position_table: str | None = None
    search_end: int = LONGEST
    decode_steps: int = DECODE_STEPS
    vllm_releases: str | None = None
    vllm_assumptions: str = VLLM_ASSUMPTIONS
    trl_version: str | None = None
    flash_attention_2_slowdown: float = 1.0
    stand_ins: tuple[str, ...] = ()


def _trl_version() -> str:
    import trl

    return trl.__version__


def run_estimate(request: Request, *, echo=print, jobs: int | None = None) -> Estimate:
    """Simulate every mode of `request`; with `jobs` > 1 (default: one per mode, up to the CPUs),
    modes run in that many forked processes, each with its own copy of the model built here. A
    model whose positions are a table (GPT-2's `n_positions`) holds every length to it
    (`within_positions`)."""
    started = time.perf_counter()
    for mode in request.modes:
        parse_mode(mode)  # a bad name fails before anything runs
    check_generation(request.config, request.training)  # what vLLM would refuse, before anything runs
    simulator = Simulator(request.config, request.training)
    request, notes = within_positions(request, simulator.positions)
    request, host = fit_host(request, simulator)
    reserve = None
    if request.memory_bytes is not None:
        reserve = run_reserve(request, simulator)
        request = replace(request, reserve_bytes=reserve.bytes)
    estimate = Estimate(request, positions=simulator.positions, notes=notes, reserve=reserve, host=host)
    _estimate_facts(estimate)
    if request.training.trl is not None and request.training.trl.trainer == "grpo":
        rates()  # the decode model's constants, once, before any fork (grpo_generation's time)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = min(len(request.modes), cpus) if jobs is None else jobs
    context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    if jobs > 1 and context is not None:
        _worker_simulator[:] = [simulator]  # each forked worker steps its own copy of the model built here
        try:
            with forked_pool(jobs, context) as pool:
                entries = pool.map(_simulate_mode, [(request, mode) for mode in request.modes])
                for mode, entry in zip(request.modes, entries, strict=True):
                    estimate.modes.append(entry)
                    if echo is not None:
                        echo(f"  simulated {mode} ({time.perf_counter() - started:.0f} s in)")
        finally:
            _worker_simulator.clear()
    else:
        pair = context if cpus > 1 else None  # a search's steps two at a time, in a forked process
        for mode in request.modes:
            estimate.modes.append(_estimate_mode(simulator, request, mode, pair=pair))
            if echo is not None:
                echo(f"  simulated {mode} ({time.perf_counter() - started:.0f} s in)")
    estimate.with_disk = past_the_host(estimate, cpus, context, echo)
    estimate.best = longest_mode(estimate)
    estimate.host_needs = host_needs(estimate, estimate.best)
    estimate.seconds = time.perf_counter() - started
    return estimate


def _estimate_facts(estimate: Estimate) -> None:
    """What the report shows of the whole run that is not a mode's: computed here, not there."""
    request = estimate.request
    training = request.training
    if estimate.positions is not None:
        estimate.position_table = estimate.positions.describe(request.config.get_text_config().model_type)
    trl = training.trl
    if trl is not None:
        estimate.trl_version = _trl_version()
        if trl.trainer == "grpo" and trl.generation.use_vllm:
            estimate.vllm_releases = vllm_range(trl.generation.vllm_version, training.four_bit)
    estimate.flash_attention_2_slowdown = attention_slowdown(FLASH_ATTENTION_2, training.device)
    estimate.stand_ins = STAND_INS if uses_linear_attention(request.config) else ()


def _mode_facts(entry: ModeEstimate, request: Request) -> None:
    """What the report shows of one mode, computed from its steps (the report only formats)."""
    step, training = entry.step, request.training
    entry.peak_parts = composition(step.peak)
    entry.recipe = recipe(entry.mode, getattr(request.config.get_text_config(), "model_type", "llama"), training)
    entry.flash_attention_2_seconds = _flash_attention_2_seconds(entry, request)
    if step.layer_offloaded_bytes:
        device = training.device
        entry.layer_seconds = (_layer_seconds(step, ("forward",), device, request),
                               _layer_seconds(step, ("backward", "recompute"), device, request))  # fmt: skip
    entry.tiers = tier_estimate(step, request)
    at = entry.longest.at_max if entry.longest is not None else None
    entry.tiers_at_max = None if at is None else tier_estimate(at, request)
    entry.none_fits = _fixed_parts(entry)
    plan = entry.generation
    if plan is not None:
        length = entry.longest.max_seq_len if entry.longest is not None else entry.cycle_length
        entry.generation_seq_len = length
        if length is not None:
            entry.generation_peak_bytes = plan.peak_bytes(length)
            if not plan.how.on_this_gpu:
                entry.server_kv_bytes = plan.simulated.kv_bytes_per_token * plan.rows * (plan.prompt_length + length)


def position_limit(request: Request, positions: PositionTable | None) -> int | None:
    """The longest `seq_len` a model's position table allows (for DPO and GRPO, completion tokens
    after the prompt's); None without a table."""
    if positions is None:
        return None
    trl = request.training.trl
    return positions.rows - (trl.row_length(0) if trl is not None else 0)


def within_positions(request: Request, positions: PositionTable | None) -> tuple[Request, list[str]]:
    """`request` within the model's position table: a length given beyond it is refused, naming
    the table's config field and its value; the default length and search grid are cut to it, and
    the notes say so."""
    limit = position_limit(request, positions)
    if limit is None or (request.seq_len <= limit and request.granularity <= limit):
        return request, []
    model_type = request.config.get_text_config().model_type
    table = positions.describe(model_type)
    what = "completion tokens after the prompt" if limit != positions.rows else "tokens per sequence"
    if limit < 2:
        raise ValueError(f"{table}: {limit} {what} leave nothing to train")
    if request.seq_len > limit and request.seq_len_given:
        raise ValueError(
            f"{table}: a length of {request.seq_len:,} would index past it (on a GPU, an index out of range in the "
            f"lookup); give --seq-len of at most {limit:,} ({what})"
        )
    notes = []
    if request.seq_len > limit:
        notes.append(f"{table}: the default length cut to its {limit:,} {what}")
        request = replace(request, seq_len=limit)
    if request.granularity > limit:
        notes.append(f"{table}: the search's grid cut to {limit:,} tokens")
        request = replace(request, granularity=limit)
    return request, notes


# "As much disk as the length takes", to say how much that is: 1 PiB.
UNBOUNDED_DISK_BYTES = 2**50


def past_the_host(estimate: Estimate, cpus: int, context, echo) -> tuple[Request, ModeEstimate] | None:
    """With a host memory and no disk tier, where host memory ends the longest mode early (at its
    answer hf_offload kept inputs on the device for want of host memory): that mode searched again
    with a disk tier of as much disk as it takes, the device's own limit with the host and disk it
    needs (`enable_activation_offloading(disk_dir=...)`, docs/tiers.md)."""
    request = estimate.request
    training = request.training
    best = longest_mode(estimate)
    if training.host_memory_bytes is None or training.disk_memory_bytes is not None or best is None:
        return None
    if not (best.longest.at_max.over_budget_bytes or best.longest.at_max.layers_kept_for_budget):
        return None  # host memory held every offloaded input at the answer: a disk adds nothing
    with_disk = replace(
        request, training=replace(training, disk_memory_bytes=UNBOUNDED_DISK_BYTES), modes=[best.mode]
    )
    simulator = Simulator(with_disk.config, with_disk.training)
    entry = _estimate_mode(simulator, with_disk, best.mode, pair=context if cpus > 1 else None)
    if echo is not None:
        echo(f"  simulated {best.mode} with a disk tier past the host's memory")
    if (entry.longest.max_seq_len or 0) <= best.longest.max_seq_len:
        return None  # the disk layers' staging takes host memory too: here it reaches no further
    return with_disk, entry


def forked_pool(workers: int, context) -> ProcessPoolExecutor:
    """The estimate's pool of forked workers (`context`: multiprocessing's "fork"), each of which
    sets torch to one thread before anything else runs in it. GNU OpenMP's thread pool does not
    survive a fork: once a parallel CPU op has run in the parent (torch.zeros(2**26).add_(1)), the
    child's first parallel op waits in its barrier for threads that are not there, forever. One
    thread costs the workers nothing: they step models on the meta device. (A "forkserver" or
    "spawn" pool would not hang either, but starts torch again in each worker and builds the model
    again: seconds per worker.)"""
    return ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_one_thread)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@dataclass(frozen=True)
class HostPlan:
    """The host RAM one rank has (`ram_bytes`, per GPU: the device preset's machine's or given),
    and what ZeRO-3's offload keeps there: `zero3_bytes` over the whole group, `zero3_rank_bytes`
    its share on each rank's host (partitioned over the `sp_size` ranks); hf_offload's budget is
    its share of what is left (`training.host_budget_bytes`)."""

    ram_bytes: int
    source: str
    zero3_bytes: int = 0
    zero3_rank_bytes: int = 0
    ranks_per_node: int = 1
    node_ram_bytes: int | None = None  # the preset machine's, where it comes from one


def ranks_per_node(training: Training) -> int:
    """The ranks of the simulated run on one node: its sequence-parallel group, up to the preset
    machine's GPUs (one rank without sequence parallelism: the step simulated is one GPU's)."""
    return max(1, min(training.sp_size, training.device.gpus_per_node))


def fit_host(request: Request, simulator: Simulator) -> tuple[Request, HostPlan | None]:
    """`request` with the host RAM per rank that hf_offload may draw on: with ZeRO-3's offload
    (`offload_params`), what its host copy of the weights, gradients and optimizer state leaves
    of the rank's RAM (an error naming both where nothing is left). None: unlimited host."""
    training = request.training
    if training.host_memory_bytes is None:
        return request, None
    device = training.device
    ranks = ranks_per_node(training)
    from_device = request.host_from == "device"
    source = f"the {device.name} preset's machine, per GPU ({device.host_source})" if from_device else "given"
    plan = HostPlan(training.host_memory_bytes, source, ranks_per_node=ranks,
                    node_ram_bytes=int(device.node_host_memory_gib * GIB) if from_device else None)  # fmt: skip
    if simulator.param_offload is None:
        return request, plan
    zero3 = simulator.param_offload.host_bytes(training.optimizer_states)
    share = -(-zero3 // training.sp_size)
    left = training.host_memory_bytes - share
    if left <= 0:
        raise ValueError(
            f"ZeRO-3's offload keeps {size(share)} per rank on the host ({size(zero3)} over {training.sp_size} "
            f"rank(s)), more than the {size(training.host_memory_bytes)} of host memory per rank ({source}): give "
            "--host-memory GIB (per GPU) larger, or --unlimited-host"
        )
    training = replace(training, host_memory_bytes=left)
    simulator.training = training  # the host budget is read per step; the model built stays the same
    return replace(request, training=training), replace(plan, zero3_bytes=zero3, zero3_rank_bytes=share)


def run_reserve(request: Request, simulator: Simulator) -> Reserve:
    """The reserve of `request`'s run (`reserve.device_reserve`), from its model: the
    units ZeRO-3 gathers (for its prefetch) and whether anything trains."""
    training = request.training
    units = ()
    if simulator.param_offload is not None:
        units = [[p.numel() for p in unit] for unit in simulator.param_offload.units]
    return device_reserve(
        usable_bytes=request.memory_bytes, dtype_bytes=training.dtype.itemsize, sp_size=training.sp_size,
        offload_params=training.offload_params, trainable=bool(simulator.trainable), units=units,
        overrides=request.reserve,
    )  # fmt: skip


def host_needs(estimate: Estimate, entry: ModeEstimate | None) -> HostNeeds | None:
    """At `entry`'s answer: hf_offload's pool per rank (host memory's share of it where a disk
    tier takes the rest), ZeRO-3's host bytes per node, and the two together per node."""
    if entry is None or entry.longest is None or entry.longest.at_max is None:
        return None
    at = entry.longest.at_max
    pool = (at.tiers.host_bytes if at.tiers is not None else at.host_bytes) or 0
    training = estimate.request.training
    ranks = ranks_per_node(training)
    zero3 = (at.params_host_bytes or 0) * ranks // training.sp_size
    if not pool and not zero3:
        return None
    return HostNeeds(pool, zero3, pool * ranks + zero3, ranks)


_worker_simulator: list = []  # a forked worker's model, built at its first mode


def _simulate_mode(task: tuple[Request, str]) -> ModeEstimate:
    request, mode = task
    if not _worker_simulator:
        _worker_simulator.append(Simulator(request.config, request.training))
    return _estimate_mode(_worker_simulator[0], request, mode)


_forked_run: list = []  # what a forked process of `_estimate_mode`'s pair simulates


def _run_forked(task: tuple[int, bool]) -> StepResult:
    seq_len, trace = task
    return _forked_run[0](seq_len, trace)


def _estimate_mode(simulator: Simulator, request: Request, mode: str, *, pair=None) -> ModeEstimate:
    """With `pair` (a fork context), the search simulates the steps it can foresee two at a time:
    one here, one in a forked process (the two lengths it starts from, and the prediction with the
    grid point after it, which end the search when the prediction holds)."""
    training = request.training
    results: dict[int, StepResult] = {}

    def run(seq_len: int, trace: bool) -> StepResult:
        if seq_len not in results or (trace and results[seq_len].trace is None):
            results[seq_len] = simulator.run(mode, seq_len, trace=trace)
        return results[seq_len]

    def run_together(tasks: list[tuple[int, bool]]) -> list[StepResult]:
        _forked_run[:] = [run]
        try:
            with forked_pool(len(tasks) - 1, pair) as pool:
                elsewhere = [pool.submit(_run_forked, task) for task in tasks[1:]]
                here = run(*tasks[0])
                found = [here] + [future.result() for future in elsewhere]
        finally:
            _forked_run.clear()
        for (seq_len, _trace), step in zip(tasks, found, strict=True):
            results[seq_len] = step
        return found

    trl = training.trl
    plan = _generation_plan(simulator, request, mode) if trl is not None and trl.trainer == "grpo" else None
    longest = slope = None
    capped = at_table = False
    if request.memory_bytes is not None:
        # What generation keeps on the GPU during the step (vLLM colocated) is not the step's, nor
        # what a real run allocates beside it (the reserve).
        step_memory = request.usable_bytes - (plan.during_step if plan is not None else 0)
        limit = None
        if plan is not None and plan.how.on_this_gpu:
            # Generation on this GPU bounds the answer, and it is known without searching the step:
            # the step at that bound fits, or the step's own search finds where below it.
            limit, _reason = plan.longest(request.usable_bytes, request.granularity)
            table = position_limit(request, simulator.positions)
            at_table = limit is not None and table is not None and limit >= table
            if at_table:  # generation would go past the model's position table: the table ends it
                limit = table
            capped = limit is None or run(limit, False).peak_bytes <= step_memory
    if request.memory_bytes is not None and capped:
        at = None if limit is None else results[limit]
        longest = LongestSequence(mode, step_memory, request.granularity, max_seq_len=limit, at_max=at,
                                  reached_limit=at_table, limit=table if at_table else LONGEST)  # fmt: skip
        if at is not None:
            longest.probes.append(Probe(limit, at.peak_bytes, True, at.host_bytes))
    elif request.memory_bytes is not None:
        lengths = search_lengths(request.config, training, mode, request.seq_len)
        limit = position_limit(request, simulator.positions)
        if limit is not None:  # both within the table: the search's line needs two lengths that run
            second = min(lengths[1], limit)
            lengths = (min(lengths[0], max(second // 2, 2)), second)
        tiered = {}
        if training.disk_memory_bytes is not None and parse_mode(mode).hf_offload:

            def storable(short: StepResult, long_: StepResult) -> int | None:
                return longest_stored(
                    short,
                    long_,
                    host_bytes=training.host_budget_bytes,
                    disk_bytes=training.disk_budget_bytes,
                    granularity=request.granularity,
                    limit=LONGEST,
                )

            tiered = {"stored": stored, "storable": storable}
        longest = longest_sequence(
            run,
            mode=mode,
            memory_bytes=step_memory,
            workspace_bytes=training.device.workspace_bytes,
            granularity=request.granularity,
            lengths=lengths,
            **tiered,
            run_together=None if pair is None else run_together,
            limit=LONGEST if limit is None else limit,
        )
        short, long_ = results[lengths[0]], results[lengths[1]]
        slope = (long_.peak_bytes - short.peak_bytes) / (long_.tokens - short.tokens)
    step = run(request.seq_len, False)
    timed = _step_time(step, simulator, request)
    entry = ModeEstimate(mode, step, timed.seconds, longest, slope, timed.exchange, timed)
    if longest is not None and longest.max_seq_len is None and not capped:
        entry.shortest = results[min(results)]
    if plan is not None:
        entry.step_capped = capped
        _with_generation(entry, plan, simulator, request, run)
    _mode_facts(entry, request)
    for result in results.values():
        result.trace = None  # the per-op lines are only for the search
    return entry


def _generation_plan(simulator: Simulator, request: Request, mode: str) -> GenerationPlan:
    """GRPO's generation before a step of `mode` (`grpo_generation`): transformers' generate
    simulated for the generation batch (its prefill is every path's), and with vLLM colocated its
    share of the GPU, sized with its profile run simulated as transformers' prefill."""
    training = request.training
    trl = training.trl
    how = trl.generation
    simulated = simulator.generate(mode, rows=trl.generation_rows, prompt_length=trl.prompt_length)
    share = None
    if how.colocated:
        profile = simulator.generate("none", rows=1, prompt_length=VLLM_MAX_NUM_BATCHED_TOKENS)
        share = vllm_share(simulator, training.device, how, profile.prefill.peak_bytes, memory=request.memory_bytes)
    plan = GenerationPlan(how, trl.generation_rows, trl.prompt_length, simulated, simulator.resident_bytes,
                          training.device.workspace_bytes, share, model_positions(request.config),
                          training.four_bit)  # fmt: skip
    hold_generation(plan, simulator, mode, request.usable_bytes, request.granularity, request.seq_len)
    return plan


def _with_generation(entry: ModeEstimate, plan: GenerationPlan, simulator: Simulator, request: Request, run) -> None:
    """The answer with generation in it: the longest completion that generation and the step
    both fit (generation's KV cache, or vLLM's, against the step's search under what vLLM keeps
    during it), the step simulated there, and the GRPO cycle's time at that length."""
    from dataclasses import replace as replaced

    entry.generation = plan
    if request.memory_bytes is not None:
        entry.step_longest = step_longest = entry.longest
        limit, entry.generation_reason = plan.longest(request.usable_bytes, request.granularity)
        entry.generation_longest = limit
        answer = step_longest.max_seq_len
        if plan.how.on_this_gpu:
            answer = None if answer is None or limit is None else min(answer, limit)
        at = None if answer is None else run(answer, False)
        reached = step_longest.reached_limit and answer == step_longest.max_seq_len
        entry.longest = replaced(step_longest, max_seq_len=answer, at_max=at, reached_limit=reached)
    length = entry.longest.max_seq_len if entry.longest is not None and entry.longest.max_seq_len else None
    length = length or request.seq_len
    step = run(length, False)
    timed = _step_time(step, simulator, request)
    entry.cycle = cycle_time(plan, length, request.training.device, step_seconds=timed.seconds,
                             scoring_share=scoring_share(step), batch_size=request.training.batch_size,
                             simulator=simulator)  # fmt: skip
    entry.cycle_length = length


def scoring_share(step: StepResult) -> float:
    """The share of the step's FLOPs in the no-grad scoring passes (reference, old log-probs)."""
    total = scoring = 0
    for (phase, *_where), (matmul, attention) in step.flops_by_tag.items():
        total += matmul + attention
        if phase == "scoring":
            scoring += matmul + attention
    return scoring / total if total else 0.0


def _step_time(step: StepResult, simulator: Simulator, request: Request, kernel: str = "sdpa") -> StepTime:
    """The step's seconds (`step_time`): with ZeRO-3 offload, its weights' gathers and the host's
    optimizer step over the trainable parameters."""
    training = request.training
    trainable = sum(p.numel() for p in simulator.trainable) if training.offload_params else 0
    return step_time(
        training.device, step.compute, step.traffic_bytes, kernel=kernel, sp_sent_bytes=step.sp_sent_bytes,
        params_gathered_bytes=step.params_gathered_bytes, host_trainable_parameters=trainable,
        link_gbps=request.link_gbps, tflops=request.tflops, efficiency=request.efficiency,
    )  # fmt: skip


def _flash_attention_2_seconds(entry: ModeEstimate, request: Request) -> float | None:
    """The step's seconds with FlashAttention 2's kernels, where they run at another rate."""
    timed = entry.time
    slowdown = attention_slowdown(FLASH_ATTENTION_2, request.training.device)
    if timed is None or slowdown == timed.slowdown:
        return None
    return timed.seconds + timed.attention * (slowdown / timed.slowdown - 1)


def tier_estimate(step: StepResult, request: Request) -> tuple[list[str], DiskTime | None] | None:
    """Where each layer call's offloaded inputs live, and the disk's time model; None without a
    disk tier (or hf_offload)."""
    if step.tiers is None or step.layer_host_bytes is None:
        return None
    places = layer_places(step.tiers, step.offloaded_layers or 0, len(step.layer_host_bytes))
    device = request.training.device
    timing = disk_time(step, request.disk_rate, lambda phases: _layer_seconds(step, phases, device, request))
    return places, timing


# The disk tier's directory in a recipe: the user's own (`disk_dir` must exist on a local disk).
DISK_DIR = "/path/to/local/disk"


def recipe(mode: str, model_type: str = "llama", training: Training | None = None) -> list[str]:
    """The lines that put a model loaded with transformers in `mode`, in the order to add them,
    with every option of `training` that the simulated step of `mode` ran with (the text's recipe
    and the JSON's both come from here). What the setup line states besides (dtype, LoRA, batch,
    optimizer, a TRL trainer) is how the user trains, not a line to add; ZeRO-3's parameter offload
    is a DeepSpeed config, named in a comment."""
    from hf_offload.config import OffloadOptions

    parsed = parse_mode(mode)
    training = Training() if training is None else training
    lines = []
    if training.offload_params:
        lines.append("# with DeepSpeed ZeRO-3: offload_param and offload_optimizer to the CPU (in its config)")
    if training.sp_size > 1:
        lines.append("from hf_offload.integrations.sequence_parallel import register_ulysses  # on every rank")
        lines.append(f"register_ulysses(model, sp_size={training.sp_size}, micro_batch_size={training.batch_size})")
    if parsed.liger:
        from hf_offload.tools.modes import liger_flce_switches

        switches = ", ".join(f"{name}={value}" for name, value in liger_flce_switches(model_type).items())
        lines.append(f"liger_kernel.transformers.apply_liger_kernel_to_{model_type}(model=model, {switches})")
    if parsed.checkpointing:
        lines.append("model.activation_checkpointing_enable()")
    if parsed.hf_offload:
        defaults = OffloadOptions()
        options = {
            name: getattr(training, name)
            for name in ("keep_last_layers", "prefetch_layers", "min_offload_bytes")
            if getattr(training, name) != getattr(defaults, name)
        }
        if parsed.budget:
            options["max_device_bytes"] = "auto"
        elif training.device_budget_bytes is not None:
            options["max_device_bytes"] = training.device_budget_bytes
        # The host budget is hf_offload's default (80% of the host's RAM), as simulated with
        # --host-memory; the disk tier's is its default too (80% of the space free in disk_dir).
        if training.disk_memory_bytes is not None:
            options["disk_dir"] = DISK_DIR
        lines.append(f"model.enable_activation_offloading({_keywords(options)})")
    if parsed.tiled:
        options = {} if training.tile_tokens is None else {"tile_tokens": training.tile_tokens}
        options.update(dict(training.tiling or ()))
        lines.append(f"model.enable_sequence_tiling({_keywords(options)})")
    return lines


def _keywords(options: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items())


def longest_mode(estimate: Estimate) -> ModeEstimate | None:
    """The mode that trains the longest sequence, if any fits; of equals (GRPO's generation can
    bound several), the one that needs the least host memory, then the fewest lines to add."""

    def rank(entry: ModeEstimate) -> tuple:
        at = entry.longest.at_max
        host = (at.host_bytes or 0) if at is not None else 0
        return entry.longest.max_seq_len, -host, -len(recipe(entry.mode))

    found = [entry for entry in estimate.modes if entry.longest is not None and entry.longest.max_seq_len]
    return max(found, key=rank, default=None)


def _fixed_parts(entry: ModeEstimate) -> NoneFits | None:
    """Where the step fits at no length: the shortest step simulated, the memory it had, what no
    length changes at its peak (weights, reference model, optimizer state, gradients), and the
    floor no length goes under: the optimizer's step (weights, gradients, optimizer state and its
    temporaries), or without one what is resident, with the library workspaces."""
    search = entry.step_longest if entry.step_longest is not None else entry.longest
    if search is None or search.max_seq_len is not None or entry.shortest is None or search.memory_bytes <= 0:
        return None
    step = entry.shortest
    fixed = {part.phase: part.bytes for part in composition(step.peak) if part.phase in _RESIDENT_PHASES}
    optimizer = max((n for tag, n in step.tag_peaks.items() if tag[0] == "optimizer"), default=0)
    resident = step.peak.live_by_tag and sum(n for tag, n in step.peak.live_by_tag.items()
                                             if tag[0] in ("weights", "reference", "optimizer"))  # fmt: skip
    floor = max(optimizer, resident or 0) + step.workspace_bytes
    usable = search.memory_bytes
    words = entry.generation.during_step_words(usable) if entry.generation is not None else None
    return NoneFits(step, usable, fixed, floor, words)


_RESIDENT_PHASES = ("weights", "reference", "optimizer", "gradients")


def _layer_seconds(step: StepResult, phases: tuple[str, ...], device: Device, request: Request) -> float:
    """Compute time of decoder layer 0 in the given phases: the step's compute time in the share of
    its FLOPs that the layer's own are (by tag; the dtypes mixed as in the whole step)."""
    own = total = 0
    for (phase, *where), (mm, att) in step.flops_by_tag.items():
        label = where[0] if where else ""
        total += mm + att
        if phase in phases and (label == "layer 0" or label.startswith("layer 0 ")):
            own += mm + att
    if not total:
        return 0.0
    seconds = compute_seconds(device, step.compute, tflops=request.tflops, efficiency=request.efficiency)
    return seconds * own / total


