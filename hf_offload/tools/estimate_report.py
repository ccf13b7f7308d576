"""`hf-offload estimate`'s report: the text and the JSON, both made from one `Estimate`
(`tools/estimate.py` computes it: the simulation, the search, generation's plan, the time model,
and every figure shown). This module only formats: it imports nothing of the simulator (an
import-linter contract in pyproject.toml), and where a line needs a fact, the `Estimate` holds it.
Its functions take the estimate's objects unannotated: naming their classes would import
`tools.estimate`, and through it the simulator.
"""

from __future__ import annotations

import json

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
