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
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from hf_offload.config import HOST_MEMORY_SHARE
from hf_offload.tools.decode_time import rates
from hf_offload.tools.devices import (
    ATTENTION_EFFICIENCY,
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    Device,
    compute_seconds,
)
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
from hf_offload.tools.simulator.linear_attention import linear_attention_lines
from hf_offload.tools.simulator.search import LONGEST, LongestSequence, Probe, longest_sequence, search_lengths
from hf_offload.tools.simulator.tiers import (
    DEFAULT_DISK_GBPS,
    DiskTime,
    describe_places,
    disk_time,
    layer_places,
    longest_stored,
    stored,
)
from hf_offload.tools.step_time import FLASH_ATTENTION_2, HOST_MEMORY_GBPS, StepTime, attention_slowdown, step_time

GIB = 2**30
# Parts of the peak under this share are summed into one line.
SMALL_PART = 0.01


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

    def as_json(self) -> dict:
        """{"modes": {MODE: {"peak_bytes", "host_bytes", "offloaded_bytes", "flops",
        "max_seq_len" (with a device memory), ...}}}, plus the setup."""
        request = self.request
        modes = {}
        for entry in self.modes:
            step = entry.step
            item = {
                "peak_bytes": step.peak_bytes,
                "host_bytes": step.host_bytes,
                "offloaded_bytes": step.offloaded_bytes,
                "flops": step.flops,
                "step_seconds": entry.step_seconds,
                "seq_len": step.seq_len,
                "sp_sent_bytes": step.sp_sent_bytes,
                "sp_exchanges": step.sp_exchanges,
                "sp_seconds": entry.sp_seconds,
                "step_seconds_range": None if entry.time is None else [entry.time.low, entry.time.high],
                "step_seconds_flash_attention_2": _flash_attention_2_seconds(entry, request),
                "params_host_bytes": step.params_host_bytes,
                "params_gathered_bytes": step.params_gathered_bytes,
                "peak": {
                    "op": step.peak.op,
                    "phase": step.peak.tag[0] if step.peak.tag else "",
                    "module": step.peak.tag[1] if len(step.peak.tag) > 1 else "",
                    "autograd_node": step.peak.node,
                    "parts": [
                        {"phase": part.phase, "what": part.what, "bytes": part.bytes}
                        for part in composition(step.peak)
                    ],
                    "workspace_bytes": step.workspace_bytes,
                },
                "tiers": tiers_json(step, request),
            }
            model_type = getattr(request.config.get_text_config(), "model_type", "llama")
            item["recipe"] = recipe(entry.mode, model_type, request.training)
            if entry.longest is not None:
                longest = entry.longest
                item["max_seq_len"] = longest.max_seq_len
                item["max_seq"] = {
                    "memory_bytes": longest.memory_bytes,
                    "granularity": longest.granularity,
                    "peak_bytes": longest.at_max.peak_bytes if longest.at_max else None,
                    "host_bytes": longest.at_max.host_bytes if longest.at_max else None,
                    "bytes_per_token": entry.bytes_per_token,
                    "reached_limit": longest.reached_limit,
                    "limit": longest.limit,
                    "tiers": tiers_json(longest.at_max, request) if longest.at_max else None,
                    "probes": [
                        {"seq_len": p.seq_len, "peak_bytes": p.peak_bytes, "fits": p.fits} for p in longest.probes
                    ],
                }
                if longest.max_seq_len is None:
                    item["max_seq"]["none_fits"] = none_fits_json(entry)
            if entry.generation is not None:
                item["generation"] = generation_json(entry)
            modes[entry.mode] = item
        training = request.training
        best = longest_mode(self)
        longest = None if best is None else {"mode": best.mode, "max_seq_len": best.longest.max_seq_len}
        if longest is not None:
            longest["with_disk"] = None
            if self.with_disk is not None:
                disk_request, entry = self.with_disk
                at = entry.longest.at_max
                longest["with_disk"] = None if at is None else {
                    "max_seq_len": entry.longest.max_seq_len,
                    "tiers": tiers_json(at, disk_request),
                }  # fmt: skip
        return {
            "longest": longest,
            "reserve": None if self.reserve is None else {
                **self.reserve.as_json(), "device_bytes": request.memory_bytes,
                "step_bytes": request.memory_bytes - self.reserve.bytes},
            "host": host_json(self, best),
            "setup": {
                "model": request.name,
                "dtype": str(training.dtype).removeprefix("torch."),
                "lora_rank": training.lora_rank,
                "lora_dtype": str(training.lora_dtype).removeprefix("torch.") if training.lora_rank else None,
                "batch_size": training.batch_size,
                "optimizer_states": training.optimizer_states,
                "device": training.device.name,
                "host_memory_bytes": training.host_memory_bytes,
                "disk_memory_bytes": training.disk_memory_bytes,
                "disk_gbps": request.disk_rate if training.disk_memory_bytes is not None else None,
                "tile_tokens": training.tile_tokens,
                "autocast": None if training.autocast is None else str(training.autocast).removeprefix("torch."),
                "padded": training.padded,
                "sp_size": training.sp_size,
                "offload_params": training.offload_params,
                "four_bit": None if training.four_bit is None else four_bit_json(training.four_bit),
                "trl": None if training.trl is None else trl_json(training.trl, training),
                "position_table": None if self.positions is None else {
                    "field": self.positions.field, "rows": self.positions.rows, "module": self.positions.module},
                "simulated": True,
            },
            "modes": modes,
        }


def generation_json(entry: ModeEstimate) -> dict:
    """GRPO's generation beside the step: how, what it holds, what limits it, the cycle's time."""
    plan, simulated = entry.generation, entry.generation.simulated
    length = entry.longest.max_seq_len if entry.longest is not None else entry.cycle_length
    share = plan.vllm
    cycle = entry.cycle
    return {
        "how": plan.how.describe(),
        "rows": plan.rows,
        "prompt_length": plan.prompt_length,
        "simulated_generate": {
            "prefill_peak_bytes": simulated.prefill.peak_bytes,
            "decode_peak_bytes": {"base": simulated.peak.base, "per_token": simulated.peak.per_token,
                                  "is": "bytes above resident at decode step k: base + per_token x k"},
            "kv_bytes_per_token": simulated.kv_bytes_per_token,
            "ops_per_decode_step": simulated.ops,
            "decode_steps_simulated": len(simulated.steps),
        },
        "vllm": None if share is None else {
            "share_bytes": share.requested, "weights_bytes": share.weights, "profile_bytes": share.profile,
            "cuda_graph_bytes": share.graphs, "non_torch_bytes": share.non_torch, "kv_cache_bytes": share.kv_bytes,
            "asleep_bytes": share.asleep, "assumptions": VLLM_ASSUMPTIONS,
        },
        "vllm_releases": vllm_range(plan.how.vllm_version, plan.four_bit) if plan.how.use_vllm else None,
        "during_step_bytes": plan.during_step,
        "trainer_resident_bytes": plan.resident,  # weights, the reference model's, optimizer state
        "workspace_bytes": plan.workspace,
        "max_seq_len_step": None if entry.step_longest is None or entry.step_capped else entry.step_longest.max_seq_len,
        "step_checked_at_generation_limit": entry.step_capped,
        "max_seq_len_generation": entry.generation_longest,
        "limited_by": entry.generation_reason or None,
        "seq_len": length,
        "peak_bytes": None if length is None else plan.peak_bytes(length),
        "cycle": None if cycle is None else {
            "seq_len": entry.cycle_length, "seconds_range": [cycle.low, cycle.high],
            "generation_seconds_range": [cycle.generation_low, cycle.generation_high], "prefill_seconds": cycle.prefill,
            "decode_seconds_range": [cycle.decode_low, cycle.decode_high], "decode_steps": cycle.steps,
            "host_bound_steps": cycle.host_bound_steps, "weight_sync_seconds": cycle.sync,
            "scoring_seconds": cycle.scoring, "training_seconds": cycle.training, "waves": cycle.waves,
            "notes": cycle.notes,
        },
    }  # fmt: skip


def four_bit_json(four_bit) -> dict:
    return {
        "bnb_4bit_quant_type": four_bit.bnb_4bit_quant_type,
        "bnb_4bit_use_double_quant": four_bit.bnb_4bit_use_double_quant,
        "bnb_4bit_compute_dtype": str(four_bit.bnb_4bit_compute_dtype).removeprefix("torch."),
        "prepare_model_for_kbit_training": four_bit.prepare_model_for_kbit_training,
    }


def trl_json(step, training: Training) -> dict:
    """The TRL step's shape; for DPO and GRPO `seq_len` and `max_seq_len` count completion tokens.
    `reference_model`: whether the trainer keeps a second model (its weights are in each peak)."""
    peft = training.lora_rank is not None
    item = {"trainer": step.trainer, "trl_version": _trl_version(), "reference_model": step.loads_reference(peft),
            "reference_pass": step.reference_pass()}  # fmt: skip
    if step.trainer != "sft":
        item["prompt_length"] = step.prompt_length
        item["length_is"] = "completion"
    if step.trainer == "dpo":
        item.update(precompute_ref_log_probs=step.precompute_ref_log_probs, ref_model=step.ref_model,
                    sync_ref_model=step.sync_ref_model)  # fmt: skip
    if step.trainer == "grpo":
        how = step.generation
        item.update(num_generations=step.num_generations, generation_batch_size=step.generation_rows,
                    beta=step.grpo_beta, old_log_probs=step.computes_old_log_probs, sync_ref_model=step.sync_ref_model,
                    use_vllm=how.use_vllm, vllm_mode=how.vllm_mode if how.use_vllm else None,
                    vllm_gpu_memory_utilization=how.vllm_gpu_memory_utilization if how.colocated else None,
                    vllm_enable_sleep_mode=how.vllm_enable_sleep_mode if how.colocated else None,
                    generation=how.describe())  # fmt: skip
    return item


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
    estimate.seconds = time.perf_counter() - started
    return estimate


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


def host_needs(estimate: Estimate, entry: ModeEstimate | None) -> tuple[int, int, int] | None:
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
    return pool, zero3, pool * ranks + zero3


def host_json(estimate: Estimate, entry: ModeEstimate | None) -> dict | None:
    host, needs = estimate.host, host_needs(estimate, entry)
    if host is None and needs is None:
        return None
    item = {"ram_per_rank_bytes": None if host is None else host.ram_bytes,
            "source": "unlimited" if host is None else host.source,
            "node_ram_bytes": None if host is None else host.node_ram_bytes,
            "zero3_per_rank_bytes": None if host is None else host.zero3_rank_bytes,
            "hf_offload_budget_bytes": estimate.request.training.host_budget_bytes}  # fmt: skip
    if needs is not None:
        pool, zero3, total = needs
        ranks = ranks_per_node(estimate.request.training)
        item.update(seq_len=entry.longest.max_seq_len, hf_offload_per_rank_bytes=pool, ranks_per_node=ranks,
                    zero3_per_node_bytes=zero3, per_node_bytes=total)  # fmt: skip
    return item


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
        step_memory = request.memory_bytes - (plan.during_step if plan is not None else 0) - request.reserve_bytes
        limit = None
        if plan is not None and plan.how.on_this_gpu:
            # Generation on this GPU bounds the answer, and it is known without searching the step:
            # the step at that bound fits, or the step's own search finds where below it.
            limit, _reason = plan.longest(request.memory_bytes, request.granularity)
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
    hold_generation(plan, simulator, mode, request.memory_bytes, request.granularity, request.seq_len)
    return plan


def _with_generation(entry: ModeEstimate, plan: GenerationPlan, simulator: Simulator, request: Request, run) -> None:
    """The answer with generation in it: the longest completion that generation and the step
    both fit (generation's KV cache, or vLLM's, against the step's search under what vLLM keeps
    during it), the step simulated there, and the GRPO cycle's time at that length."""
    from dataclasses import replace as replaced

    entry.generation = plan
    if request.memory_bytes is not None:
        entry.step_longest = step_longest = entry.longest
        limit, entry.generation_reason = plan.longest(request.memory_bytes, request.granularity)
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


def tiers_json(step: StepResult, request: Request) -> dict | None:
    found = tier_estimate(step, request)
    if found is None:
        return None
    places, timing = found
    plan = step.tiers
    disk = None
    if timing is not None:
        disk = {
            "gbps": timing.gbps,
            "layer_bytes": timing.layer_bytes,
            "write_seconds": timing.write_seconds,
            "read_seconds": timing.read_seconds,
            "layer_forward_seconds": timing.forward_seconds,
            "layer_backward_seconds": timing.backward_seconds,
            "hidden": timing.hidden,
            "exposed_seconds": timing.exposed_seconds,
        }
    return {
        "layers": places,
        "disk_layers": plan.disk_layers,
        "host_bytes": plan.host_bytes,
        "staging_bytes": plan.staging_bytes,
        "disk_bytes": plan.disk_bytes,
        "fits": plan.fits,
        "host_short": plan.host_short,
        "disk": disk,
    }


# -- text ------------------------------------------------------------------------------------------


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def size(nbytes: float | None) -> str:
    """GiB with two decimals, or MiB under one GiB (tiny models)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


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


# What the GRPO estimate says of where generation runs, by TRL's setting (one home for each).
GENERATION_SERVER = (
    "generation runs in the vLLM server, on other GPUs: this GPU's answer is the training step's; the server's "
    "GPUs need vLLM's weights and the KV cache of the generation batch"
)


def length_name(training: Training) -> str:
    """What the searched length counts: a TRL DPO or GRPO step's completions, else whole sequences."""
    return "completion" if training.trl is not None and training.trl.trainer != "sft" else "sequence"


def longest_mode(estimate: Estimate) -> ModeEstimate | None:
    """The mode that trains the longest sequence, if any fits; of equals (GRPO's generation can
    bound several), the one that needs the least host memory, then the fewest lines to add."""

    def rank(entry: ModeEstimate) -> tuple:
        at = entry.longest.at_max
        host = (at.host_bytes or 0) if at is not None else 0
        return entry.longest.max_seq_len, -host, -len(recipe(entry.mode))

    found = [entry for entry in estimate.modes if entry.longest is not None and entry.longest.max_seq_len]
    return max(found, key=rank, default=None)


def _headline_lines(estimate: Estimate) -> list[str]:
    """The answer first: the longest sequence per mode, and what to add for the longest."""
    request = estimate.request
    device = request.training.device
    where = device.name if request.memory_bytes == int(device.memory_gib * GIB) else "the device"
    training = request.training
    trl = "" if training.trl is None else f", {training.trl.describe(peft=training.lora_rank is not None)}"
    lines = [
        f"Longest {length_name(training)} in {size(request.memory_bytes)} ({where}), batch {training.batch_size} "
        f"(simulated){trl}:"
    ]

    ordered = sorted(estimate.modes, key=lambda entry: -(entry.longest.max_seq_len or 0))
    if any(entry.generation is not None for entry in estimate.modes):
        lines.extend(_generation_how_lines(estimate))
    for entry in ordered:
        longest = entry.longest
        if longest.max_seq_len is None:
            lines.append(f"  {entry.mode:<34}{'none fits':>12}")
            lines.extend(f"    {line}" for line in _none_fits_lines(entry, request))
            continue
        at = longest.at_max
        value = _longest_value(longest)
        host = f", host {size(at.host_bytes)}" if at.host_bytes else ""
        if at.tiers is not None:
            host = f", {_tiers_needed(at, request)}"
        what = "step peak" if entry.generation is not None else "peak"
        lines.append(f"  {entry.mode:<34}{value:>12} tokens  ({what} {size(at.peak_bytes)}{host})")
        if entry.generation is not None:
            lines.extend(f"    {line}" for line in _generation_lines(entry, request))
    lines.extend(_position_lines(estimate))
    best = longest_mode(estimate)
    lines.extend(_reserve_lines(estimate))
    lines.extend(_host_lines(estimate, best))
    lines.extend(_host_node_lines(estimate, best))
    if best is not None:
        model_type = getattr(request.config.get_text_config(), "model_type", "llama")
        steps = recipe(best.mode, model_type, request.training)
        if steps:
            amount = f"{best.longest.max_seq_len:,}" + (" tokens" if length_name(training) == "sequence" else
                                                          "-token completions")  # fmt: skip
            lines.append(f"To train {amount} ({best.mode}), add after loading the model, "
                         "with `import hf_offload`:")  # fmt: skip
            lines.extend(f"    {line}" for line in steps)
    return lines


def _generation_how_lines(estimate: Estimate) -> list[str]:
    trl = estimate.request.training.trl
    how = trl.generation
    lines = [f"  generation: {how.describe()}, {trl.generation_rows} rows decoded together (the generation batch)"]
    if how.use_vllm:
        lines.append(f"    vLLM releases assumed: {vllm_range(how.vllm_version, estimate.request.training.four_bit)}")
    if how.colocated:
        lines.append(f"    vLLM assumed (not run here): {VLLM_ASSUMPTIONS}")
    elif not how.use_vllm:
        lines.append(
            "    simulated: transformers' generate on the meta device, through the prefill and "
            f"{DECODE_STEPS} decode steps; the KV cache's growth, exactly linear in the step, extrapolated; every row "
            "decodes to the longest completion"
        )
    else:
        lines.append(f"    {GENERATION_SERVER}")
    return lines


def _generation_lines(entry: ModeEstimate, request: Request) -> list[str]:
    """Under a GRPO answer: generation's peak there and what limits each, then the cycle's time."""
    plan = entry.generation
    length = entry.longest.max_seq_len
    step_alone = entry.step_longest.max_seq_len if entry.step_longest is not None else None
    alone = "none" if step_alone is None else f"{step_alone:,}"
    if entry.step_capped:
        alone = "further (the step fits there; its own limit is not searched)"
    lines = []
    if plan.how.on_this_gpu:
        peak = plan.peak_bytes(length)
        limit = "-" if entry.generation_longest is None else f"{entry.generation_longest:,}"
        beside = f" beside the {size(plan.during_step)} vLLM keeps during it" if plan.during_step else ""
        lines.append(
            f"generation's peak {size(peak)} (set by {entry.generation_reason}: up to {limit}); the step alone"
            f"{beside} reaches {alone}"
        )
    else:
        rows = plan.rows
        kv = plan.simulated.kv_bytes_per_token * rows * (plan.prompt_length + length)
        lines.append(f"the server's GPUs: vLLM's weights and {size(kv)} of KV cache for {rows} rows at that length")
    cycle = entry.cycle
    if cycle is not None:
        lines.append(_cycle_line(entry))
        lines.extend(f"  {note}" for note in cycle.notes)
    return lines


def _cycle_line(entry: ModeEstimate) -> str:
    cycle, plan = entry.cycle, entry.generation
    micro = plan.rows // (entry.step.batch_size or 1)
    host = f", {cycle.host_bound_steps:,} of them host-bound at the slow end" if cycle.host_bound_steps else ""
    sync = ""
    if plan.how.use_vllm:  # TRL's push of the policy's weights into vLLM before each generation (modelled)
        sync = f" + weight sync {cycle.sync * 1e3:.0f} ms" if cycle.sync < 1 else f" + weight sync {cycle.sync:.1f} s"
    return (
        f"one generation batch at {entry.cycle_length:,} tokens (simulated; time modelled): {_seconds(cycle.low)}-"
        f"{_seconds(cycle.high)} = generation {_seconds(cycle.generation_low)}-{_seconds(cycle.generation_high)} "
        f"(prefill {cycle.prefill:.1f} s + {cycle.steps:,} decode steps{host}{sync}) + scoring "
        f"{_seconds(cycle.scoring)} + training {_seconds(cycle.training)} ({micro} policy steps)"
    )


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s"


def _fixed_parts(entry: ModeEstimate) -> tuple[StepResult, int, dict[str, int], int] | None:
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
    return step, search.memory_bytes, fixed, floor


def none_fits_json(entry: ModeEstimate) -> dict | None:
    found = _fixed_parts(entry)
    if found is None:
        return {"generation": entry.generation_reason} if entry.generation_reason else None
    step, usable, fixed, floor = found
    return {"seq_len": step.seq_len, "peak_bytes": step.peak_bytes, "usable_bytes": usable,
            "fixed_bytes": floor, "fixed_parts_at_peak": fixed, "workspace_bytes": step.workspace_bytes,
            "generation": entry.generation_reason or None,
            "vllm_during_step": entry.generation.during_step_words(usable) if entry.generation else None}  # fmt: skip


def _none_fits_lines(entry: ModeEstimate, request: Request) -> list[str]:
    """Why no length fits: what the shortest step simulated held, and the floor no length goes
    under (the optimizer's step: weights, gradients, optimizer state); or generation's limit."""
    lines = []
    found = _fixed_parts(entry)
    if found is not None:
        step, usable, fixed, floor = found
        named = ", ".join(f"{_PHASE_WORDS[phase]} {size(n)}" for phase, n in fixed.items())
        lines.append(f"at {step.seq_len:,} tokens the step peaks at {size(step.peak_bytes)} of {size(usable)} usable "
                     f"({_where(step)}; {named} there)")  # fmt: skip
        what = "weights, gradients and optimizer state" if request.training.optimizer_states else "the weights"
        if "reference" in fixed:
            what = what.replace("weights", "weights (the reference model's too)", 1)
        verdict = "more than the device has: no length fits" if floor > usable else "the rest is the step's"
        lines.append(f"{what} alone, at any length (the optimizer's step, with the library workspaces), peak at "
                     f"{size(floor)} of {size(usable)}: {verdict}")  # fmt: skip
    if entry.generation is not None and entry.generation_longest is None and entry.generation.how.on_this_gpu:
        lines.append(f"generation: {entry.generation_reason}")
    if found is not None and entry.generation is not None:
        share = entry.generation.during_step_words(found[1])
        lines.extend([share] if share else [])
    return lines


def _host_lines(estimate: Estimate, best: ModeEstimate | None) -> list[str]:
    """What the longest needs of the host: with unlimited host memory, the RAM its pool takes; where
    the host's memory ended it early, what a disk tier beside it reaches and needs."""
    training = estimate.request.training
    if best is None or best.longest.at_max is None or not best.longest.at_max.host_bytes:
        return []
    if training.host_memory_bytes is None:
        pool = best.longest.at_max.host_bytes
        return [
            f"  host RAM: hf_offload's pinned pool takes {size(pool)} at {best.longest.max_seq_len:,} tokens (it "
            f"may use {HOST_MEMORY_SHARE:.0%} of the RAM: a machine with {size(pool / HOST_MEMORY_SHARE)}); with "
            "less, --host-memory GIB says how much disk it needs instead"
        ]
    if estimate.with_disk is None:
        return []
    disk_request, entry = estimate.with_disk
    at = entry.longest.at_max
    if at is None:
        return []
    return [
        f"  past the {size(training.host_memory_bytes)} of host RAM hf_offload draws on, a disk tier "
        f"(enable_activation_offloading(disk_dir=...), {disk_request.disk_rate:g} GB/s) reaches "
        f"{entry.longest.max_seq_len:,} tokens: "
        f"{_tiers_needed(at, disk_request)}"
    ]


def table(header: list[str], rows: list[list[str]], widths: tuple[int, ...]) -> list[str]:
    """A text table: the first column left-aligned, the next `len(widths) - 1` right-aligned, each
    at least its width in `widths` and wider where a cell needs it (two spaces always between
    columns: a step of 20,059,145 TFLOP and 18,781.58 s stays two numbers); a column after those
    (free text, "peak at") follows two spaces after the last."""
    sized = [
        max(minimum, max(len(row[i]) for row in [header, *rows]) + 2)
        for i, minimum in enumerate(widths)
    ]
    lines = []
    for row in [header, *rows]:
        figures = zip(row[1 : len(widths)], sized[1:], strict=True)
        cells = [f"{row[0]:<{sized[0]}}"] + [f"{cell:>{width}}" for cell, width in figures]
        rest = "".join(f"  {cell}" for cell in row[len(widths) :])
        lines.append("".join(cells) + rest)
    return lines


def _reserve_lines(estimate: Estimate) -> list[str]:
    """What the answer leaves free of the device's memory, item by item."""
    reserve, memory = estimate.reserve, estimate.request.memory_bytes
    if reserve is None:
        return []
    left = memory - reserve.bytes
    within = f"so each step above peaks within {size(left)}" if left > 0 else "more than the device's memory"
    lines = [f"  left free for what a real run allocates beside the step (--reserve NAME=GIB to change): "
             f"{size(reserve.bytes)}, {within} of {size(memory)}"]  # fmt: skip
    for item in reserve.items:
        lines.append(f"    {item.name}: {item.what}: {size(item.bytes)} ({item.source})")
    return lines


def _host_node_lines(estimate: Estimate, best: ModeEstimate | None) -> list[str]:
    """The host the answer needs per node, against the host it was given (per rank and node)."""
    needs, host = host_needs(estimate, best), estimate.host
    lines = []
    if host is not None:
        zero3 = f", ZeRO-3's share {size(host.zero3_rank_bytes)} of it" if host.zero3_rank_bytes else ""
        budget = estimate.request.training.host_budget_bytes
        share = f"{HOST_MEMORY_SHARE:.0%}"
        lines.append(f"  host memory per rank: {size(host.ram_bytes)} ({host.source}){zero3}; hf_offload's "
                     f"budget {size(budget)} (its {share} of the rest; --unlimited-host lifts it)")  # fmt: skip
    if needs is not None:
        pool, zero3, total = needs
        node = None if host is None else host.node_ram_bytes
        machine = "" if node is None else f" of the machine's {size(node)}"
        ranks = ranks_per_node(estimate.request.training)
        parts = f"hf_offload {size(pool)} x {ranks} rank(s)" + (f" + ZeRO-3 {size(zero3)}" if zero3 else "")
        lines.append(f"  host per node at {best.longest.max_seq_len:,} tokens: {parts} = {size(total)}{machine}")
    return lines


def format_estimate(estimate: Estimate, *, device_given: bool) -> str:
    request = estimate.request
    lines = [_setup_line(request, estimate.host), ""]
    if request.memory_bytes is not None:
        lines.extend(_headline_lines(estimate))
        lines.append("")
    elif estimate.notes:
        lines.extend([*_position_lines(estimate), ""])
    large = max(entry.step.peak_bytes for entry in estimate.modes) >= GIB
    unit, scale = ("GiB", GIB) if large else ("MiB", 2**20)
    flop_unit, flop_scale = ("TFLOP", 1e12) if large else ("GFLOP", 1e9)

    def amount(nbytes):
        return "-" if nbytes is None else f"{nbytes / scale:.2f}"

    header = ["mode", "peak " + unit, "host " + unit, "moved " + unit, flop_unit, "step s", "peak at"]
    rows = [
        [entry.mode, amount(entry.step.peak_bytes), amount(entry.step.host_bytes), amount(entry.step.offloaded_bytes),
         f"{entry.step.flops / flop_scale:.0f}", f"{entry.step_seconds:.2f}", _where(entry.step)]
        for entry in estimate.modes
    ]  # fmt: skip
    lines.extend(table(header, rows, widths=(32, 10, 10, 11, 9, 8)))
    lines.append(
        "(peak: allocated device bytes, what torch.cuda.max_memory_allocated reports; host: hf_offload's pinned "
        f"pool; moved: bytes offloaded per step; {flop_unit}: flop_counter's count, attention over the full square)"
    )
    for entry in estimate.modes:
        lines.append("")
        lines.extend(_composition_lines(entry))
        copies = _copy_line(entry, request) or _nothing_moved_line(entry, request)
        if copies:
            lines.append(copies)
        lines.extend(_parallel_lines(entry, request))
        lines.extend(_tier_lines(entry.step, request))
        if entry.generation is not None and request.memory_bytes is None:
            peak = entry.generation.peak_bytes(entry.cycle_length)
            where = "on the server's GPUs" if peak is None else f"peak {size(peak)} on this GPU"
            lines.append(f"  generation at {entry.cycle_length:,} tokens ({entry.generation.how.describe()}): {where}")
            lines.append(f"  {_cycle_line(entry)}")
    if request.memory_bytes is not None:
        lines.append("")
        lines.extend(_longest_lines(estimate))
    lines.append("")
    lines.extend(_assumption_lines(request, device_given=device_given))
    lines.extend(_kernel_lines(estimate))
    lines.append(f"simulated in {estimate.seconds:.0f} s")
    return "\n".join(lines)


def _setup_line(request: Request, host: HostPlan | None = None) -> str:
    training = request.training
    dtype = str(training.dtype).removeprefix("torch.")
    if training.lora_rank is None:
        tuning = "full fine-tuning"
    else:
        targets = training.lora_targets if isinstance(training.lora_targets, str) else ",".join(training.lora_targets)
        adapters = str(training.lora_dtype).removeprefix("torch.")
        tuning = f"LoRA r={training.lora_rank} on {targets} ({adapters} adapters)"
        if training.four_bit is not None:
            tuning += f" on a {training.four_bit.describe()}"
    optimizer = "AdamW step" if training.optimizer_states else "no optimizer step (forward and backward)"
    host_bytes = training.host_memory_bytes
    host_text = "unlimited host memory" if host_bytes is None else f"{size(host_bytes)} of host memory"
    if host is not None:  # the rank's RAM, ZeRO-3's share of it included
        host_text = f"{size(host.ram_bytes)} of host memory"
    if training.disk_memory_bytes is not None:
        host_text += f" and {size(training.disk_memory_bytes)} of disk at {request.disk_rate:g} GB/s"
    tiles = "" if training.tile_tokens is None else f", {training.tile_tokens} tokens per tiled slice"
    if training.autocast is not None:
        dtype = f"{dtype} weights under {str(training.autocast).removeprefix('torch.')} autocast"
    padded = ", padded" if training.padded else ""
    if training.sp_size > 1:
        padded += f", one rank of {training.sp_size} under Ulysses sequence parallelism"
    if training.offload_params:
        padded += ", weights and optimizer on the host (ZeRO-3 offload)"
    step, length = "the loss", f"{request.seq_len} tokens"
    if training.trl is not None:
        padded += f", {training.trl.describe(peft=training.lora_rank is not None)}"
        step = "TRL's fused loss head"
        if training.trl.trainer != "sft":
            length = f"{request.seq_len}-token completions"
    return (
        f"{request.name}: {tuning}, {dtype}, batch {training.batch_size} x {length}{padded}, "
        f"{optimizer}, {host_text}{tiles}; simulated on the meta device (the real step, without data: transformers, "
        f"PEFT, checkpointing, hf_offload's engine, {step})"
    )


_PLACES = {
    "loss": "the loss head",
    "lm_head": "the loss head",
    "norm": "the final norm",
    "embed_tokens": "the embeddings",
}


def _where(step: StepResult) -> str:
    """"in backward, in layer 31 mlp, at aten.mm (MmBackward0)"."""
    peak = step.peak
    phase, module = (peak.tag + ("", ""))[:2]
    op = peak.op.removesuffix(".default")
    node = f" ({peak.node})" if peak.node else ""
    place = f", in {_PLACES.get(module, module)}" if module else ""
    return f"in {phase}{place}, at aten.{op}{node}"


_RESIDENT_PHASES = ("weights", "reference", "optimizer", "gradients")
_PHASE_WORDS = {
    "weights": "weights",
    "reference": "the reference model's weights",
    "scoring": "made under no_grad (reference, old log-probs) by",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "forward": "made in forward by",
    "recompute": "recomputed in backward by",
    "backward": "made in backward by",
    "restored": "brought back by hf_offload for",
}


def _composition_lines(entry: ModeEstimate) -> list[str]:
    step = entry.step
    lines = [f"{entry.mode}: {size(step.peak_bytes)} at the peak, {_where(step)}"]
    small = 0
    for part in composition(step.peak):
        if part.bytes < SMALL_PART * step.tracked_peak_bytes:
            small += part.bytes
            continue
        words = _PHASE_WORDS.get(part.phase, part.phase)
        what = f" {part.what}" if part.what else ""
        each = f" ({size(part.bytes / part.layers)} each)" if part.layers > 1 else ""
        lines.append(f"  {words}{what}: {size(part.bytes)}{each}")
    workspace = step.peak.workspace
    if workspace is not None:
        lines.append(f"  {workspace[0]} (the kernel's own, at that op): {size(workspace[1])}")
    lines.append(f"  cuBLAS workspaces: {size(step.workspace_bytes)}")
    if small:
        lines.append(f"  smaller parts together: {size(small)}")
    return lines


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


def _copy_line(entry: ModeEstimate, request: Request) -> str | None:
    step = entry.step
    if not step.layer_offloaded_bytes:
        return None
    device = request.training.device
    link = (request.link_gbps or device.link_gbps) * 1e9
    copy = step.layer_offloaded_bytes / link
    forward = _layer_seconds(step, ("forward",), device, request)
    backward = _layer_seconds(step, ("backward", "recompute"), device, request)
    hides = "yes" if copy <= forward and copy <= backward else "no"
    return (
        f"  per offloaded layer: {size(step.layer_offloaded_bytes)} each way, {copy * 1e3:.1f} ms at "
        f"{link / 1e9:g} GB/s, against {forward * 1e3:.1f} ms of the layer's forward and {backward * 1e3:.1f} ms of "
        f"its backward: copies hide behind compute: {hides}"
    )


# Why hf_offload left saved tensors on the device (the engine's KEEP_REASONS), for a mode that moved nothing.
_KEPT = {
    "too_small": "under min_offload_bytes ({min_bytes})",
    "parameter": "weights or views of them",
    "leaf": "inputs requiring grad",
    "kept_layer": "in the last {keep} layer(s), kept (keep_last_layers)",
    "kept_for_budget": "in layers the device budget had room for",
    "duplicate": "already offloaded (shared storage)",
    "unsupported": "of a kind it does not move",
    "over_budget": "past the host budget",
    "no_host_memory": "without host memory",
}


def _nothing_moved_line(entry: ModeEstimate, request: Request) -> str | None:
    """A mode with hf_offload that moved nothing says why: at short sequences of a small model
    every saved tensor is under min_offload_bytes."""
    step, training = entry.step, request.training
    if not parse_mode(entry.mode).hf_offload or step.offloaded_bytes or not step.offload_stats:
        return None
    tensors, nbytes = step.offload_stats.get("kept_tensors", {}), step.offload_stats.get("kept_bytes", {})
    reasons = [
        f"{count} {_KEPT.get(reason, reason)}: {size(nbytes.get(reason, 0))}"
        for reason, count in sorted(tensors.items(), key=lambda item: -nbytes.get(item[0], 0))
        if count
    ]
    kept = "; ".join(reasons).format(min_bytes=size(training.min_offload_bytes), keep=training.keep_last_layers)
    return f"  hf_offload moved nothing: the saved tensors it saw stayed on the device: {kept or 'none seen'}"


def _parallel_lines(entry: ModeEstimate, request: Request) -> list[str]:
    step, device = entry.step, request.training.device
    lines = []
    if step.sp_size > 1:
        lines.append(
            f"  sequence parallel: this rank's {step.rank_seq_len} tokens of {step.seq_len}; its {step.sp_exchanges} "
            f"all-to-alls send {size(step.sp_sent_bytes)} (and receive as much), {entry.sp_seconds * 1e3:.1f} ms at "
            f"{device.peer_gbps:g} GB/s per direction, in the step time"
        )
    if step.params_host_bytes is not None:
        link = (request.link_gbps or device.link_gbps) * 1e9
        gathered = step.params_gathered_bytes
        timed = entry.time
        low, high = timed.host_optimizer
        lines.append(
            "  parameters offloaded (ZeRO-3, offload_param and offload_optimizer to the CPU): "
            f"{size(step.params_host_bytes)} on the host (weights, float32 gradients, master weights and AdamW "
            f"states); the device gathered {size(gathered)} of weights, {gathered / link:.2f} s at {link / 1e9:g} "
            f"GB/s, prefetched behind compute ({timed.exposed_weights:.2f} s of it not hidden); the host's optimizer "
            f"step {low:.1f}-{high:.1f} s (DeepSpeed's CPU Adam at {HOST_MEMORY_GBPS[1]:g}-{HOST_MEMORY_GBPS[0]:g} "
            "GB/s of host memory, assumed), in the step time at the middle of that range"
        )
    return lines


def _tiers_needed(step: StepResult, request: Request) -> str:
    """What a step with a disk tier needs: "host 96.00 GiB + disk 168.00 GiB, the disk's time hidden"."""
    plan = step.tiers
    found = tier_estimate(step, request)
    timing = found[1] if found else None
    text = f"host {size(plan.host_bytes)} + disk {size(plan.disk_bytes)}"
    if timing is not None:
        text += f", the disk's time {'hidden' if timing.hidden else f'not hidden (~{timing.exposed_seconds:.3g} s)'}"
    if not plan.fits:
        text += ", more than host and disk hold"
    return text


def _tier_lines(step: StepResult, request: Request) -> list[str]:
    found = tier_estimate(step, request)
    if found is None:
        return []
    places, timing = found
    plan, training = step.tiers, request.training
    if plan.host_short:
        verdict = "does not fit: the staging buffers alone exceed the host budget"
    elif not plan.fits:
        verdict = "does not fit: the disk budget is short"
    else:
        verdict = "fits"
    lines = [
        f"  host memory and disk (hf_offload's budgets: {size(training.host_budget_bytes)} of host memory, "
        f"{size(training.disk_budget_bytes)} of disk): {describe_places(places)}; needs host "
        f"{size(plan.host_bytes)} ({size(plan.staging_bytes)} of it staging), disk {size(plan.disk_bytes)}: {verdict}"
    ]
    if timing is not None:
        hides = "yes" if timing.hidden else f"no (about {timing.exposed_seconds:.3g} s added to the step)"
        lines.append(
            f"  per disk layer: {size(timing.layer_bytes)}, {timing.write_seconds:.2f} s to write and as long to "
            f"read at {timing.gbps:g} GB/s, against {timing.forward_seconds:.2f} s of a layer's forward and "
            f"{timing.backward_seconds:.2f} s of its backward: the disk's time hides behind compute: {hides}"
        )
    return lines


def _longest_value(longest: LongestSequence, *, grouped: bool = True) -> str:
    """The longest length as shown: '>= LONGEST' where the search ran out of lengths, and marked *
    where the model's position table stopped it, not memory."""
    if longest.reached_limit and longest.limit >= LONGEST:
        return f">= {LONGEST:,}" if grouped else f">={LONGEST}"
    value = f"{longest.max_seq_len:,}" if grouped else f"{longest.max_seq_len}"
    return value + ("*" if longest.reached_limit else "")


def _position_lines(estimate: Estimate) -> list[str]:
    """What the model's position table did to the request and to the search."""
    lines = [f"  {note}" for note in estimate.notes]
    capped = [entry.mode for entry in estimate.modes if entry.longest is not None and entry.longest.reached_limit
              and entry.longest.limit < LONGEST]  # fmt: skip
    if capped and estimate.positions is not None:
        table = estimate.positions.describe(estimate.request.config.get_text_config().model_type)
        lines.append(
            f"  * {table}: no longer sequence runs (on a GPU, an index out of range), whatever the memory; "
            f"{', '.join(capped)} fit there"
        )
    return lines


def _longest_lines(estimate: Estimate) -> list[str]:
    request = estimate.request
    memory = request.memory_bytes
    lines = [
        f"longest {length_name(request.training)} in {size(memory)} (batch {request.training.batch_size}; bisection "
        "on multiples of "
        f"{request.granularity} tokens, from a bracket predicted by two simulated lengths):",
    ]
    rows = []
    for entry in estimate.modes:
        longest = entry.longest
        at = longest.at_max
        value = "none" if longest.max_seq_len is None else _longest_value(longest, grouped=False)
        per_token = "-" if entry.bytes_per_token is None else f"{entry.bytes_per_token / 1e6:.3f}"
        # With a disk tier the step was simulated with every layer offloaded: the host holds what
        # the tiers' plan leaves it, not all of that.
        host_there = None if at is None else at.tiers.host_bytes if at.tiers is not None else at.host_bytes
        rows.append([entry.mode, value, per_token, gib(at.peak_bytes if at else None), gib(host_there),
                     str(len(longest.probes))])  # fmt: skip
    header = ["mode", "max seq", "MB/token", "peak GiB there", "host GiB there", "runs"]
    lines.extend(table(header, rows, widths=(32, 9, 10, 16, 16, 6)))
    for entry in estimate.modes:
        at = entry.longest.at_max
        if at is not None and at.tiers is not None:
            lines.append(f"  {entry.mode} at {at.seq_len:,} tokens: {_tiers_needed(at, request)}")
    host = request.training.host_memory_bytes
    if host is None:
        needs = [e for e in estimate.modes if e.longest.at_max and e.longest.at_max.host_bytes]
        if needs:
            lines.append(
                "host memory is unlimited here: give --host-memory GIB to hold hf_offload to a host's RAM (tensors "
                "over its budget stay on the device, as in training; the answer then says what a disk tier beside it "
                "reaches)"
            )
    return lines


def _assumption_lines(request: Request, *, device_given: bool) -> list[str]:
    device = request.training.device
    note = "" if device_given else " (the default: --device to choose one, --list-devices for all)"
    lines = [
        f"assumed device: {device.name}{note}: {device.tflops:g} TFLOP/s sustained bf16 matmul, "
        f"{device.fp32_tflops:g} float32, {device.link_gbps:g} GB/s host link per direction, "
        f"{device.memory_tbps:g} TB/s memory, compute capability {'.'.join(map(str, device.compute_capability))}",
        f"  source: {device.source}",
        f"  step time: matmuls at {request.efficiency or MATMUL_EFFICIENCY:g} of the rate of their dtype, attention "
        f"(what the kernel computes: half the square when causal) at {ATTENTION_EFFICIENCY:g}, memory-bound ops at "
        f"{MEMORY_EFFICIENCY:g} of the memory bandwidth (fitted to the H200's ten step times, each within 7.1% of a "
        "fit to the other nine; published steps of 0.5M-15M tokens: docs/published.md); offloading's copies not "
        "included",
    ]
    lines.extend(linear_attention_lines(request.config))
    if request.tflops is not None:
        lines.append(f"  matmul rate: {request.tflops:g} TFLOP/s, given with --tflops")
    if request.link_gbps is not None:
        lines.append(f"  host link: {request.link_gbps:g} GB/s, given with --link-gbps")
    if request.efficiency is not None:
        lines.append(f"  matmul efficiency: {request.efficiency:g}, given with --efficiency")
    if request.training.disk_memory_bytes is not None:
        given = "given with --disk-gbps" if request.disk_gbps is not None else "assumed: one NVMe drive's low end"
        lines.append(
            f"  disk: {request.disk_rate:g} GB/s each way ({given}); a disk layer's write hides when it takes no "
            "longer than a layer's forward, its read when no longer than a layer's backward (docs/tiers.md)"
        )
    return lines


def _kernel_lines(estimate: Estimate) -> list[str]:
    """On Hopper the attention kernel moves a long step's time by more than anything else."""
    request = estimate.request
    flash = [(entry.mode, _flash_attention_2_seconds(entry, request)) for entry in estimate.modes]
    flash = [(mode, seconds) for mode, seconds in flash if seconds is not None]
    if not flash:
        return []
    slowdown = attention_slowdown(FLASH_ATTENTION_2, request.training.device)
    steps = ", ".join(f"{mode} {seconds:.2f} s" for mode, seconds in flash)
    return [
        "  attention kernel: the step times are for cuDNN's or FlashAttention 3's kernels (what SDPA runs on Hopper "
        f"with a cuDNN newer than 9.15); with FlashAttention 2's (attn_implementation=\"flash_attention_2\", or SDPA's "
        f"flash backend) attention takes {slowdown:g}x as long (fitted to published H100 steps, docs/published.md): "
        + steps
    ]


def format_json(estimate: Estimate) -> str:
    return json.dumps(estimate.as_json(), indent=2)
