"""`hf-offload estimate`'s report: the text and the JSON, both made from one `Estimate`
(`tools/estimate.py` computes it: the simulation, the search, generation's plan, the time model,
and every figure shown). This module only formats: it imports nothing of the simulator (an
import-linter contract in pyproject.toml), and where a line needs a fact, the `Estimate` holds it.
Its functions take the estimate's objects unannotated: naming their classes would import
`tools.estimate`, and through it the simulator.
"""

from __future__ import annotations

import json

from hf_offload.config import HOST_MEMORY_SHARE
from hf_offload.tools.devices import ATTENTION_EFFICIENCY, MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from hf_offload.tools.modes import parse_mode
from hf_offload.tools.step_time import HOST_MEMORY_GBPS

GIB = 2**30


def estimate_json(estimate) -> dict:
    """{"modes": {MODE: {"peak_bytes", "host_bytes", "offloaded_bytes", "flops",
    "max_seq_len" (with a device memory), ...}}}, plus the setup."""
    request = estimate.request
    modes = {}
    for entry in estimate.modes:
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
            "step_seconds_flash_attention_2": entry.flash_attention_2_seconds,
            "params_host_bytes": step.params_host_bytes,
            "params_gathered_bytes": step.params_gathered_bytes,
            "peak": {
                "op": step.peak.op,
                "phase": step.peak.tag[0] if step.peak.tag else "",
                "module": step.peak.tag[1] if len(step.peak.tag) > 1 else "",
                "autograd_node": step.peak.node,
                "parts": [
                    {"phase": part.phase, "what": part.what, "bytes": part.bytes}
                    for part in entry.peak_parts
                ],
                "workspace_bytes": step.workspace_bytes,
            },
            "tiers": tiers_json(step, entry.tiers),
        }
        item["recipe"] = entry.recipe
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
                "tiers": tiers_json(longest.at_max, entry.tiers_at_max) if longest.at_max else None,
                "probes": [
                    {"seq_len": p.seq_len, "peak_bytes": p.peak_bytes, "fits": p.fits} for p in longest.probes
                ],
            }
            if longest.max_seq_len is None:
                item["max_seq"]["none_fits"] = none_fits_json(entry)
        if entry.generation is not None:
            item["generation"] = generation_json(entry, estimate)
        modes[entry.mode] = item
    training, positions = request.training, estimate.positions
    best = estimate.best
    longest = None if best is None else {"mode": best.mode, "max_seq_len": best.longest.max_seq_len}
    if longest is not None:
        longest["with_disk"] = None
        if estimate.with_disk is not None:
            disk_request, entry = estimate.with_disk
            at = entry.longest.at_max
            longest["with_disk"] = None if at is None else {
                "max_seq_len": entry.longest.max_seq_len,
                "tiers": tiers_json(at, entry.tiers_at_max),
            }  # fmt: skip
    return {
        "longest": longest,
        "reserve": None if estimate.reserve is None else {
            **estimate.reserve.as_json(), "device_bytes": request.memory_bytes,
            "step_bytes": request.memory_bytes - estimate.reserve.bytes},
        "host": host_json(estimate),
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
            "trl": None if training.trl is None else trl_json(training.trl, training, estimate.trl_version),
            "position_table": None if positions is None else {
                "field": positions.field, "rows": positions.rows, "module": positions.module},
            "simulated": True,
        },
        "modes": modes,
    }


def generation_json(entry, estimate) -> dict:
    """GRPO's generation beside the step: how, what it holds, what limits it, the cycle's time."""
    plan, simulated = entry.generation, entry.generation.simulated
    length = entry.generation_seq_len
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
            "asleep_bytes": share.asleep, "assumptions": estimate.vllm_assumptions,
        },
        "vllm_releases": estimate.vllm_releases if plan.how.use_vllm else None,
        "memory_bytes": estimate.request.usable_bytes,  # what generation may use: the memory less the reserve
        "during_step_bytes": plan.during_step,
        "trainer_resident_bytes": plan.resident,  # weights, the reference model's, optimizer state
        "workspace_bytes": plan.workspace,
        "max_seq_len_step": None if entry.step_longest is None or entry.step_capped else entry.step_longest.max_seq_len,
        "step_checked_at_generation_limit": entry.step_capped,
        "max_seq_len_generation": entry.generation_longest,
        "limited_by": entry.generation_reason or None,
        "seq_len": length,
        "peak_bytes": entry.generation_peak_bytes,
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


def trl_json(step, training, trl_version: str | None) -> dict:
    """The TRL step's shape; for DPO and GRPO `seq_len` and `max_seq_len` count completion tokens.
    `reference_model`: whether the trainer keeps a second model (its weights are in each peak)."""
    peft = training.lora_rank is not None
    item = {"trainer": step.trainer, "trl_version": trl_version, "reference_model": step.loads_reference(peft),
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


def host_json(estimate) -> dict | None:
    host, needs, entry = estimate.host, estimate.host_needs, estimate.best
    if host is None and needs is None:
        return None
    item = {"ram_per_rank_bytes": None if host is None else host.ram_bytes,
            "source": "unlimited" if host is None else host.source,
            "node_ram_bytes": None if host is None else host.node_ram_bytes,
            "zero3_per_rank_bytes": None if host is None else host.zero3_rank_bytes,
            "hf_offload_budget_bytes": estimate.request.training.host_budget_bytes}  # fmt: skip
    if needs is not None:
        pool, zero3, total, ranks = needs
        item.update(seq_len=entry.longest.max_seq_len, hf_offload_per_rank_bytes=pool, ranks_per_node=ranks,
                    zero3_per_node_bytes=zero3, per_node_bytes=total)  # fmt: skip
    return item


def tiers_json(step, found) -> dict | None:
    """`step`'s tiers, from `found` (`tier_estimate`'s answer for it)."""
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


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def size(nbytes: float | None) -> str:
    """GiB with two decimals, or MiB under one GiB (tiny models)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def none_fits_json(entry) -> dict | None:
    found = entry.none_fits
    if found is None:
        return {"generation": entry.generation_reason} if entry.generation_reason else None
    step, usable, fixed, floor = found.step, found.usable_bytes, found.fixed, found.floor_bytes
    return {"seq_len": step.seq_len, "peak_bytes": step.peak_bytes, "usable_bytes": usable,
            "fixed_bytes": floor, "fixed_parts_at_peak": fixed, "workspace_bytes": step.workspace_bytes,
            "generation": entry.generation_reason or None,
            "vllm_during_step": found.vllm_during_step}  # fmt: skip


def format_json(estimate) -> str:
    return json.dumps(estimate_json(estimate), indent=2)


# -- text ------------------------------------------------------------------------------------------

# Parts of the peak under this share are summed into one line.
SMALL_PART = 0.01


# What the GRPO estimate says of where generation runs, by TRL's setting (one home for each).
GENERATION_SERVER = (
    "generation runs in the vLLM server, on other GPUs: this GPU's answer is the training step's; the server's "
    "GPUs need vLLM's weights and the KV cache of the generation batch"
)


def length_name(training) -> str:
    """What the searched length counts: a TRL DPO or GRPO step's completions, else whole sequences."""
    return "completion" if training.trl is not None and training.trl.trainer != "sft" else "sequence"


def _headline_lines(estimate) -> list[str]:
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
            lines.extend(f"    {line}" for line in _none_fits_lines(entry, request.training))
            continue
        at = longest.at_max
        value = _longest_value(longest, estimate.search_end)
        host = f", host {size(at.host_bytes)}" if at.host_bytes else ""
        if at.tiers is not None:
            host = f", {_tiers_needed(at, entry.tiers_at_max)}"
        what = "step peak" if entry.generation is not None else "peak"
        lines.append(f"  {entry.mode:<34}{value:>12} tokens  ({what} {size(at.peak_bytes)}{host})")
        if entry.generation is not None:
            lines.extend(f"    {line}" for line in _generation_lines(entry))
    lines.extend(_position_lines(estimate))
    best = estimate.best
    lines.extend(_reserve_lines(estimate))
    lines.extend(_host_lines(estimate, best))
    lines.extend(_host_node_lines(estimate, best))
    if best is not None:
        steps = best.recipe
        if steps:
            amount = f"{best.longest.max_seq_len:,}" + (" tokens" if length_name(training) == "sequence" else
                                                          "-token completions")  # fmt: skip
            lines.append(f"To train {amount} ({best.mode}), add after loading the model, "
                         "with `import hf_offload`:")  # fmt: skip
            lines.extend(f"    {line}" for line in steps)
    return lines


def _generation_how_lines(estimate) -> list[str]:
    trl = estimate.request.training.trl
    how = trl.generation
    lines = [f"  generation: {how.describe()}, {trl.generation_rows} rows decoded together (the generation batch)"]
    if how.use_vllm:
        lines.append(f"    vLLM releases assumed: {estimate.vllm_releases}")
    if how.colocated:
        lines.append(f"    vLLM assumed (not run here): {estimate.vllm_assumptions}")
    elif not how.use_vllm:
        lines.append(
            "    simulated: transformers' generate on the meta device, through the prefill and "
            f"{estimate.decode_steps} decode steps; the KV cache's growth, exactly linear in the step, extrapolated; "
            "every row decodes to the longest completion"
        )
    else:
        lines.append(f"    {GENERATION_SERVER}")
    return lines


def _generation_lines(entry) -> list[str]:
    """Under a GRPO answer: generation's peak there and what limits each, then the cycle's time."""
    plan = entry.generation
    step_alone = entry.step_longest.max_seq_len if entry.step_longest is not None else None
    alone = "none" if step_alone is None else f"{step_alone:,}"
    if entry.step_capped:
        alone = "further (the step fits there; its own limit is not searched)"
    lines = []
    if plan.how.on_this_gpu:
        peak = entry.generation_peak_bytes
        limit = "-" if entry.generation_longest is None else f"{entry.generation_longest:,}"
        beside = f" beside the {size(plan.during_step)} vLLM keeps during it" if plan.during_step else ""
        lines.append(
            f"generation's peak {size(peak)} (set by {entry.generation_reason}: up to {limit}); the step alone"
            f"{beside} reaches {alone}"
        )
    else:
        lines.append(f"the server's GPUs: vLLM's weights and {size(entry.server_kv_bytes)} of KV cache for {plan.rows} "
                     "rows at that length")  # fmt: skip
    cycle = entry.cycle
    if cycle is not None:
        lines.append(_cycle_line(entry))
        lines.extend(f"  {note}" for note in cycle.notes)
    return lines


def _cycle_line(entry) -> str:
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


def _none_fits_lines(entry, training) -> list[str]:
    """Why no length fits: what the shortest step simulated held, and the floor no length goes
    under (the optimizer's step: weights, gradients, optimizer state); or generation's limit."""
    lines = []
    found = entry.none_fits
    if found is not None:
        step, usable, fixed, floor = found.step, found.usable_bytes, found.fixed, found.floor_bytes
        named = ", ".join(f"{_PHASE_WORDS[phase]} {size(n)}" for phase, n in fixed.items())
        lines.append(f"at {step.seq_len:,} tokens the step peaks at {size(step.peak_bytes)} of {size(usable)} usable "
                     f"({_where(step)}; {named} there)")  # fmt: skip
        what = "weights, gradients and optimizer state" if training.optimizer_states else "the weights"
        if "reference" in fixed:
            what = what.replace("weights", "weights (the reference model's too)", 1)
        verdict = "more than the device has: no length fits" if floor > usable else "the rest is the step's"
        lines.append(f"{what} alone, at any length (the optimizer's step, with the library workspaces), peak at "
                     f"{size(floor)} of {size(usable)}: {verdict}")  # fmt: skip
    if entry.generation is not None and entry.generation_longest is None and entry.generation.how.on_this_gpu:
        lines.append(f"generation: {entry.generation_reason}")
    if found is not None and entry.generation is not None:
        share = found.vllm_during_step
        lines.extend([share] if share else [])
    return lines


def _host_lines(estimate, best) -> list[str]:
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
        f"{_tiers_needed(at, entry.tiers_at_max)}"
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


def _reserve_lines(estimate) -> list[str]:
    """What the answer leaves free of the device's memory, item by item."""
    reserve, memory = estimate.reserve, estimate.request.memory_bytes
    if reserve is None:
        return []
    left = estimate.request.usable_bytes
    # GRPO's generation on this GPU is held to the same memory as the step.
    generating = any(e.generation is not None and e.generation.how.on_this_gpu for e in estimate.modes)
    beside, peaks = (" and generation", "each step and generation above peak") if generating else (
        "", "each step above peaks")  # fmt: skip
    within = f"so {peaks} within {size(left)}" if left > 0 else "more than the device's memory"
    lines = [f"  left free for what a real run allocates beside the step{beside} (--reserve NAME=GIB to change): "
             f"{size(reserve.bytes)}, {within} of {size(memory)}"]  # fmt: skip
    for item in reserve.items:
        lines.append(f"    {item.name}: {item.what}: {size(item.bytes)} ({item.source})")
    return lines


def _host_node_lines(estimate, best) -> list[str]:
    """The host the answer needs per node, against the host it was given (per rank and node)."""
    needs, host = estimate.host_needs, estimate.host
    lines = []
    if host is not None:
        zero3 = f", ZeRO-3's share {size(host.zero3_rank_bytes)} of it" if host.zero3_rank_bytes else ""
        budget = estimate.request.training.host_budget_bytes
        share = f"{HOST_MEMORY_SHARE:.0%}"
        lines.append(f"  host memory per rank: {size(host.ram_bytes)} ({host.source}){zero3}; hf_offload's "
                     f"budget {size(budget)} (its {share} of the rest; --unlimited-host lifts it)")  # fmt: skip
    if needs is not None:
        pool, zero3, total, ranks = needs
        node = None if host is None else host.node_ram_bytes
        machine = "" if node is None else f" of the machine's {size(node)}"
        parts = f"hf_offload {size(pool)} x {ranks} rank(s)" + (f" + ZeRO-3 {size(zero3)}" if zero3 else "")
        lines.append(f"  host per node at {best.longest.max_seq_len:,} tokens: {parts} = {size(total)}{machine}")
    return lines


def format_estimate(estimate, *, device_given: bool) -> str:
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
        lines.extend(_tier_lines(entry, request))
        if entry.generation is not None and request.memory_bytes is None:
            peak = entry.generation_peak_bytes
            where = "on the server's GPUs" if peak is None else f"peak {size(peak)} on this GPU"
            lines.append(f"  generation at {entry.cycle_length:,} tokens ({entry.generation.how.describe()}): {where}")
            lines.append(f"  {_cycle_line(entry)}")
    if request.memory_bytes is not None:
        lines.append("")
        lines.extend(_longest_lines(estimate))
    lines.append("")
    lines.extend(_assumption_lines(estimate, device_given=device_given))
    lines.extend(_kernel_lines(estimate))
    lines.append(f"simulated in {estimate.seconds:.0f} s")
    return "\n".join(lines)


def _setup_line(request, host=None) -> str:
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


def _where(step) -> str:
    """"in backward, in layer 31 mlp, at aten.mm (MmBackward0)"."""
    peak = step.peak
    phase, module = (peak.tag + ("", ""))[:2]
    op = peak.op.removesuffix(".default")
    node = f" ({peak.node})" if peak.node else ""
    place = f", in {_PLACES.get(module, module)}" if module else ""
    return f"in {phase}{place}, at aten.{op}{node}"


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


def _composition_lines(entry) -> list[str]:
    step = entry.step
    lines = [f"{entry.mode}: {size(step.peak_bytes)} at the peak, {_where(step)}"]
    small = 0
    for part in entry.peak_parts:
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


def _copy_line(entry, request) -> str | None:
    step = entry.step
    if not step.layer_offloaded_bytes:
        return None
    link = request.link_rate * 1e9
    copy = step.layer_offloaded_bytes / link
    forward, backward = entry.layer_seconds
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


def _nothing_moved_line(entry, request) -> str | None:
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


def _parallel_lines(entry, request) -> list[str]:
    step, device = entry.step, request.training.device
    lines = []
    if step.sp_size > 1:
        lines.append(
            f"  sequence parallel: this rank's {step.rank_seq_len} tokens of {step.seq_len}; its {step.sp_exchanges} "
            f"all-to-alls send {size(step.sp_sent_bytes)} (and receive as much), {entry.sp_seconds * 1e3:.1f} ms at "
            f"{device.peer_gbps:g} GB/s per direction, in the step time"
        )
    if step.params_host_bytes is not None:
        link = request.link_rate * 1e9
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


def _tiers_needed(step, found) -> str:
    """What a step with a disk tier needs: "host 96.00 GiB + disk 168.00 GiB, the disk's time hidden"
    (`found`: where its layers live and the disk's time, `tier_estimate`)."""
    plan = step.tiers
    timing = found[1] if found else None
    text = f"host {size(plan.host_bytes)} + disk {size(plan.disk_bytes)}"
    if timing is not None:
        text += f", the disk's time {'hidden' if timing.hidden else f'not hidden (~{timing.exposed_seconds:.3g} s)'}"
    if not plan.fits:
        text += ", more than host and disk hold"
    return text


def _tier_lines(entry, request) -> list[str]:
    found = entry.tiers
    if found is None:
        return []
    places, timing = found
    plan, training = entry.step.tiers, request.training
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


def _longest_value(longest, end: int, *, grouped: bool = True) -> str:
    """The longest length as shown: '>= END' where the search ran out of lengths (`end`, its last),
    and marked * where the model's position table stopped it, not memory."""
    if longest.reached_limit and longest.limit >= end:
        return f">= {end:,}" if grouped else f">={end}"
    value = f"{longest.max_seq_len:,}" if grouped else f"{longest.max_seq_len}"
    return value + ("*" if longest.reached_limit else "")


def _position_lines(estimate) -> list[str]:
    """What the model's position table did to the request and to the search."""
    lines = [f"  {note}" for note in estimate.notes]
    capped = [entry.mode for entry in estimate.modes if entry.longest is not None and entry.longest.reached_limit
              and entry.longest.limit < estimate.search_end]  # fmt: skip
    if capped and estimate.position_table is not None:
        table = estimate.position_table
        lines.append(
            f"  * {table}: no longer sequence runs (on a GPU, an index out of range), whatever the memory; "
            f"{', '.join(capped)} fit there"
        )
    return lines


def _longest_lines(estimate) -> list[str]:
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
        value = "none" if longest.max_seq_len is None else _longest_value(longest, estimate.search_end, grouped=False)
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
            lines.append(f"  {entry.mode} at {at.seq_len:,} tokens: {_tiers_needed(at, entry.tiers_at_max)}")
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


def _assumption_lines(estimate, *, device_given: bool) -> list[str]:
    request = estimate.request
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
    lines.extend(_linear_attention_lines(estimate.stand_ins))
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


def _linear_attention_lines(stand_ins: tuple[str, ...]) -> list[str]:
    """What the estimate's output says of a hybrid model's kernels (`stand_ins`: those that stand in
    on meta for its Gated DeltaNet layers' GPU kernels; none for a model without them)."""
    if not stand_ins:
        return []
    return [
        "  linear attention (Gated DeltaNet layers): the GPU kernels stand in on meta with the memory their own code "
        f"allocates on CUDA: {'; '.join(stand_ins)} (hf_offload/tools/simulator/linear_attention.py); step times leave "
        "out those kernels' own compute (they count none); under --sp N they run for heads / N over the whole sequence "
        "between two all-to-alls, as training runs them",
    ]


def _kernel_lines(estimate) -> list[str]:
    """On Hopper the attention kernel moves a long step's time by more than anything else."""
    flash = [(entry.mode, entry.flash_attention_2_seconds) for entry in estimate.modes]
    flash = [(mode, seconds) for mode, seconds in flash if seconds is not None]
    if not flash:
        return []
    slowdown = estimate.flash_attention_2_slowdown
    steps = ", ".join(f"{mode} {seconds:.2f} s" for mode, seconds in flash)
    return [
        "  attention kernel: the step times are for cuDNN's or FlashAttention 3's kernels (what SDPA runs on Hopper "
        f"with a cuDNN newer than 9.15); with FlashAttention 2's (attn_implementation=\"flash_attention_2\", or SDPA's "
        f"flash backend) attention takes {slowdown:g}x as long (fitted to published H100 steps, docs/published.md): "
        + steps
    ]


def describe_places(places: list[str]) -> str:
    """The places as runs of layers: "layers 0-20 on disk, 21-30 in host memory, 31 on the device"."""
    words = {"disk": "on disk", "host": "in host memory", "device": "on the device"}
    runs: list[tuple[int, int, str]] = []
    for index, place in enumerate(places):
        if runs and runs[-1][2] == place:
            runs[-1] = (runs[-1][0], index, place)
        else:
            runs.append((index, index, place))
    parts = [f"{first}-{last}" if first != last else f"{first}" for first, last, _ in runs]
    return "layers " + ", ".join(f"{span} {words[place]}" for span, (_, _, place) in zip(parts, runs, strict=True))
