"""GRPO's generation on the user's GPU, for `hf-offload estimate --trainer grpo`: what it holds
beside the training step, the longest completion both fit, and its time.

TRL 1.16 generates in one of three ways (`TrlGeneration`, GRPOConfig's names):

- transformers' `generate` on the training model (`use_vllm=False`, the default): simulated on the
  meta device (`simulator.generation`), the KV cache of the whole generation batch growing a token
  a step beside the trainer's weights and optimizer state.
- vLLM colocated (`vllm_mode="colocate"`, TRL's default mode with vLLM): vLLM takes
  `vllm_gpu_memory_utilization` of the GPU's memory for its own copy of the weights, its profile
  run's activations, CUDA graphs and the KV cache (the rest), for the whole run; with
  `vllm_enable_sleep_mode` TRL puts it to sleep (level 2) after each generation, so that the
  step runs beside what sleeping vLLM keeps.
- vLLM in a server (`vllm_mode="server"`): generation runs on other GPUs; this GPU runs the step.

vLLM does not run on these machines: its share is modelled from its sizing code and documents
(`VLLM_ASSUMPTIONS` names each assumption); a GPU stage measures it
(`python -m hf_offload.tools.benchmarks.trl_trainers --stage generation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_offload.tools.decode_time import rates
from hf_offload.tools.devices import RESERVED_GIB, TIME_MODEL, Device
from hf_offload.tools.generation_limits import Positions, vllm_max_model_len
from hf_offload.tools.simulator.generation import GenerationResult
from hf_offload.tools.simulator.trl import TrlGeneration

GIB = 2**30
VLLM_BLOCK_TOKENS = 16  # CacheConfig's default block size
VLLM_MAX_NUM_BATCHED_TOKENS = 4096  # what TRL passes to LLM(...) (vllm_generation.py)
# A CUDA graph pool of 0.5 GiB: logged sizes are 0.36 GiB (gpustack/runner#251) and 0.65 GiB
# (gemma-3-4b, vllm-project/vllm#21489); TRL's max_num_seqs (the generation batch) keeps the
# captured batch sizes few. Charged inside the share (vLLM >= 0.21 estimates it while profiling).
VLLM_CUDA_GRAPH_BYTES = GIB // 2
VLLM_NON_TORCH_BYTES = int(0.07 * GIB)  # NCCL and the like at one GPU (vllm-project/vllm#21489's log)
VLLM_ASSUMPTIONS = (
    f"vLLM's share is vllm_gpu_memory_utilization x the GPU's total memory (gpu_worker.py: requested_memory); "
    f"inside it its weights (the base model as the trainer holds it, LoRA merged away; 4-bit in vLLM's bitsandbytes "
    f"loading as bitsandbytes packs it here), its profile run's activations (a forward of max_num_batched_tokens="
    f"{VLLM_MAX_NUM_BATCHED_TOKENS} tokens, TRL's value: transformers' prefill of as many tokens, simulated, its KV "
    f"cache left out), a CUDA graph pool of {VLLM_CUDA_GRAPH_BYTES / GIB:g} GiB (logged: 0.36-0.65 GiB), "
    f"{VLLM_NON_TORCH_BYTES / GIB:g} GiB outside PyTorch, and the KV cache: the rest, in blocks of "
    f"{VLLM_BLOCK_TOKENS} tokens; vllm_max_model_length as given, or else set to prompt + completion where the "
    "length vLLM derives from the model does not fit its KV cache (generation_limits); no prefix sharing "
    "between a prompt's generations (a prompt's blocks are few beside a long completion's); asleep (level 2, "
    "TRL's) it keeps the graph pool and what is outside "
    "PyTorch; rows the KV cache cannot hold at once wait for a free slot (decoded in waves)"
)


@dataclass(frozen=True)
class VllmShare:
    """What colocated vLLM holds on the GPU (`VLLM_ASSUMPTIONS`)."""

    requested: int  # utilization x the GPU's total memory
    weights: int
    profile: int  # its profile run's activation peak
    graphs: int
    non_torch: int
    kv_token_bytes: int  # one sequence's KV cache per token

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.weights - self.profile - self.graphs - self.non_torch

    @property
    def kv_blocks(self) -> int:
        return max(self.kv_bytes, 0) // (VLLM_BLOCK_TOKENS * self.kv_token_bytes)

    @property
    def asleep(self) -> int:
        """What it keeps asleep at level 2: the graph pool and what is outside PyTorch."""
        return self.graphs + self.non_torch

    def sequences(self, tokens: int) -> int:
        """How many sequences of `tokens` tokens its KV cache holds at once."""
        return self.kv_blocks // math.ceil(tokens / VLLM_BLOCK_TOKENS)

    def longest_sequence(self) -> int:
        """The longest single sequence its KV cache holds (vLLM refuses to start below one)."""
        return self.kv_blocks * VLLM_BLOCK_TOKENS


def vllm_share(simulator, device: Device, how: TrlGeneration, profile_prefill_bytes: int, *,
               memory: int | None = None) -> VllmShare:  # fmt: skip
    """vLLM's share for this simulator's model on `device` (or on a GPU of `memory` usable bytes,
    where given); `profile_prefill_bytes`: transformers' prefill of VLLM_MAX_NUM_BATCHED_TOKENS
    tokens above resident, as simulated (its KV cache is taken out here)."""
    from hf_offload.tools.simulator.generation import kv_bytes_per_token

    kv_token = kv_bytes_per_token(simulator.config, simulator.training.dtype)
    adapters = sum(p.numel() * p.element_size() for p in simulator.trainable) if simulator.training.lora_rank else 0
    usable = device.memory_gib * GIB if memory is None else memory
    total = int(usable + RESERVED_GIB * GIB)  # what vLLM reads as the GPU's total memory
    return VllmShare(
        requested=int(how.vllm_gpu_memory_utilization * total),
        weights=simulator.weight_bytes - adapters,
        profile=max(profile_prefill_bytes - VLLM_MAX_NUM_BATCHED_TOKENS * kv_token, 0),
        graphs=VLLM_CUDA_GRAPH_BYTES,
        non_torch=VLLM_NON_TORCH_BYTES,
        kv_token_bytes=kv_token,
    )


@dataclass
class GenerationPlan:
    """Generation beside the step on one GPU: what it holds during the step and at its own peak,
    and the longest completion it allows."""

    how: TrlGeneration
    rows: int  # the generation batch on this GPU
    prompt_length: int
    simulated: GenerationResult  # transformers' generate, simulated (its prefill sizes vLLM's too)
    resident: int  # the trainer's bytes while generating: weights, reference model, optimizer state
    workspace: int
    vllm: VllmShare | None = None
    positions: Positions | None = None  # the model's positions, with its rope scaling (generation_limits)
    four_bit: object | None = None  # the policy's 4-bit setup (simulator.FourBit), None: not 4-bit

    @property
    def during_step(self) -> int:
        """What generation keeps on this GPU while the step runs."""
        if self.vllm is None:
            return 0
        return self.vllm.asleep if self.how.vllm_enable_sleep_mode else self.vllm.requested

    def peak_bytes(self, completion: int) -> int | None:
        """This GPU's bytes at generation's peak for completions of `completion` tokens (None:
        generation runs elsewhere)."""
        if not self.how.on_this_gpu:
            return None
        if self.vllm is None:
            return self.resident + self.simulated.peak_bytes(completion) + self.workspace
        return self.resident + self.vllm.requested + self.workspace

    def during_step_words(self, step_memory: int) -> str | None:
        """Where the step fits at no length beside colocated vLLM: what vLLM's share took from it,
        and what sleep mode gives back (None: vLLM keeps nothing during the step)."""
        if self.vllm is None or not self.during_step:
            return None
        share = self.vllm
        took = (f"vLLM's share ({share.requested / GIB:.2f} GiB: vllm_gpu_memory_utilization "
                f"{self.how.vllm_gpu_memory_utilization:g} of the GPU) stays on it during the step, which had "
                f"{step_memory / GIB:.2f} GiB")  # fmt: skip
        if self.how.vllm_enable_sleep_mode:
            return f"{took}: asleep vLLM keeps {share.asleep / GIB:.2f} GiB (its CUDA graphs, what is outside PyTorch)"
        return (f"{took}: sleep mode (--vllm-enable-sleep-mode, GRPOConfig.vllm_enable_sleep_mode) gives back all but "
                f"{share.asleep / GIB:.2f} GiB of it during the step; a smaller --vllm-gpu-memory-utilization "
                "gives back the rest of what it does not need")  # fmt: skip

    def length_cap(self) -> tuple[int | None, str]:
        """The longest completion the model's positions allow after the prompt (with vLLM: its
        max_model_len), memory aside, and what sets it; None: nothing does."""
        if self.how.use_vllm:
            tokens, what = vllm_max_model_len(self.positions, self.how.vllm_max_model_length)
            if tokens is None:
                return None, ""
            return tokens - self.prompt_length, f"{what}: a row stops there"
        if self.positions is None:
            return None, ""
        return self.positions.tokens - self.prompt_length, (
            f"the model's positions ({self.positions.source}); TRL's generate does not stop there (it runs to "
            "max_completion_length) but past them the model runs on positions it was not trained on")

    def longest(self, memory: int, granularity: int) -> tuple[int | None, str]:
        """The longest completion generation allows on `memory` bytes (a multiple of
        `granularity`, or the model's own limit `length_cap`; None: none), and what sets it."""
        cap, capped_by = self.length_cap()
        if cap is not None and cap < 1:
            return None, f"{capped_by}, {self.prompt_length:,} tokens of prompt leave none to generate"
        if not self.how.on_this_gpu:
            return None, "generation runs on the server's GPUs"
        found, reason = self._longest_in_memory(memory, granularity)
        if found is not None and cap is not None and found >= cap:
            return cap, capped_by
        if self.vllm is not None and found is not None:
            max_model_len, _ = vllm_max_model_len(self.positions, self.how.vllm_max_model_length)
            fits = self.vllm.longest_sequence()
            if self.how.vllm_max_model_length is None and max_model_len is not None:
                # vLLM checks at start that one sequence of max_model_len fits its KV cache.
                reason += (f"; set vllm_max_model_length to {self.prompt_length + found:,} (prompt + completion): "
                           f"TRL's default leaves vLLM at the derived {max_model_len:,}, which its KV cache "
                           f"({fits:,} tokens) cannot hold, and vLLM refuses to start (\"To serve at least one "
                           "request with the models's max seq len ... Try increasing `gpu_memory_utilization` or "
                           "decreasing `max_model_len`\")")  # fmt: skip
        return found, reason

    def _longest_in_memory(self, memory: int, granularity: int) -> tuple[int | None, str]:
        if self.vllm is None:
            budget = memory - self.resident - self.workspace
            found = self.simulated.longest(budget, granularity=granularity)
            return found, "the generation batch's KV cache (transformers' generate)"
        share = self.vllm
        if self.resident + share.requested + self.workspace > memory:
            return None, (f"vLLM's share ({share.requested / GIB:.2f} GiB) and the trainer's weights and optimizer "
                          f"state ({self.resident / GIB:.2f} GiB) exceed the device while it generates (sleep mode "
                          "does not help then: give a smaller --vllm-gpu-memory-utilization)")  # fmt: skip
        if share.kv_bytes <= 0:
            return None, f"vLLM's share leaves no KV cache ({share.kv_bytes / GIB:.2f} GiB)"
        given = self.how.vllm_max_model_length
        if given is not None and share.longest_sequence() < given:
            return None, (f"vLLM refuses to start: one sequence of max_model_len {given:,} needs "
                          f"{given * share.kv_token_bytes / GIB:.2f} GiB of KV cache, more than its "
                          f"{share.kv_bytes / GIB:.2f} GiB (\"Try increasing `gpu_memory_utilization` or decreasing "
                          f"`max_model_len`\"): its KV cache holds {share.longest_sequence():,} tokens")  # fmt: skip
        longest = (share.longest_sequence() - self.prompt_length) // granularity * granularity
        return (longest if longest > 0 else None), "one sequence in vLLM's KV cache"


# Pageable host copies, the fast end of what the H200 measured (9-16 GB/s; DESIGN.md): PEFT's
# 4-bit merge copies with `.to("cpu")` and `.to(device)`, not from pinned buffers.
PAGEABLE_GBPS = 16.0


def four_bit_merge_seconds(simulator) -> float:
    """TRL's sync of a 4-bit policy with LoRA: `merge_adapter`, then `unmerge_adapter`. PEFT 0.22
    (lora/bnb.py, Linear4bit.merge and unmerge) dequantizes each 4-bit weight, adds (or takes away)
    the adapters' product and quantizes again from a CPU copy (`Params4bit(w_data.to("cpu"),
    ...).to(weight.device)`): each 4-bit weight crosses to the host and back in bf16, twice."""
    if not simulator.training.lora_rank or simulator.training.four_bit is None:
        return 0.0
    states = {}  # by identity; PEFT's LoRA layer (it has a base_layer) shows its base layer's weight as its own
    for module in simulator.base.modules():
        if hasattr(module, "base_layer"):
            continue
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            states[id(state)] = state
    quantized = sum(math.prod(state.shape) for state in states.values())
    return 2 * 2 * quantized * 2 / (PAGEABLE_GBPS * 1e9)


@dataclass
class CycleTime:
    """One generation batch's seconds: generation (prefill, decode, weight sync), scoring (the
    no-grad passes over the batch) and training (the policy steps through it), at the two ends of
    the decode range."""

    prefill: float
    decode_low: float
    decode_high: float
    sync: float
    scoring: float
    training: float
    steps: int  # decode steps
    host_bound_steps: int
    waves: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def generation_low(self) -> float:
        return self.prefill + self.decode_low + self.sync

    @property
    def generation_high(self) -> float:
        return self.prefill + self.decode_high + self.sync

    @property
    def low(self) -> float:
        return self.generation_low + self.scoring + self.training

    @property
    def high(self) -> float:
        return self.generation_high + self.scoring + self.training


def cycle_time(plan: GenerationPlan, completion: int, device: Device, *, step_seconds: float,
               scoring_share: float, batch_size: int, simulator) -> CycleTime:  # fmt: skip
    """The GRPO cycle at `completion` tokens: the step simulated once (one micro-batch of the
    scoring passes, one policy step), its seconds split by the scoring passes' share of its FLOPs;
    the batch's `rows / batch_size` micro-batches each score and step."""
    from hf_offload.tools.decode_time import decode_seconds

    found = rates()
    generated = plan.simulated
    micro_batches = plan.rows // batch_size
    prefill = TIME_MODEL.seconds(device, generated.prefill.compute, generated.prefill.traffic_bytes)
    steps = completion - 1
    lines = generated.compute.values()
    flops = (sum(line.base for line in lines), sum(line.per_token for line in lines))
    notes: list[str] = []
    waves = 1
    base_weights = simulator.weight_bytes - (
        sum(p.numel() * p.element_size() for p in simulator.trainable) if simulator.training.lora_rank else 0
    )
    bandwidth = device.memory_tbps * 1e12 * found.memory_efficiency
    if not plan.how.use_vllm:
        operand, traffic = generated.operand, generated.traffic
        bytes_line = (operand.base + traffic.base, operand.per_token + traffic.per_token)
        host = generated.ops * found.host_seconds_per_op
        low, high, host_bound = decode_seconds(device, bytes_line, flops, steps=steps, host_seconds=host)
        sync = 0.0
        notes.append(
            f"transformers' generate: {generated.ops:,} aten ops a step, {host * 1e3:.1f} ms of the host's time at "
            f"{found.host_seconds_per_op * 1e6:.1f} us an op (the slow end; none at the fast end)"
        )
    else:
        embeddings = simulator.base.get_input_embeddings().weight
        read = base_weights - embeddings.numel() * embeddings.element_size()
        kv = generated.kv_bytes_per_token
        concurrent = plan.rows
        if plan.vllm is not None:
            concurrent = max(min(plan.rows, plan.vllm.sequences(plan.prompt_length + completion)), 1)
        waves = math.ceil(plan.rows / concurrent)
        bytes_line = (read + concurrent * plan.prompt_length * kv, concurrent * kv)
        scale = concurrent / plan.rows
        lone = (plan.prompt_length * kv, kv) if concurrent == 1 else None  # one long row at a time
        low, high, host_bound = decode_seconds(device, bytes_line, (flops[0] * scale, flops[1] * scale), steps=steps,
                                               lone_kv=lone)  # fmt: skip
        if lone is not None and found.kv_efficiency_batch_1 is not None:
            notes.append(
                f"one row at a time: the slow end reads its KV cache at {found.kv_efficiency_batch_1:.2f} of the "
                "memory bandwidth, as vLLM 0.4.2 did at 200K tokens (Llama-3-8B, one H800: 30 ms a token, "
                "lmdeploy#1608); the fast end at the batch-1 CUDA graph step's"
            )
        low, high = low * waves, high * waves
        # TRL pushes the trainer's weights into vLLM before each generation (PEFT: merged, then unmerged):
        # a copy on this GPU when colocated, over NCCL to the server (the peer link assumed) when not.
        merges = 2 * 2 * base_weights if simulator.training.lora_rank else 0
        round_trip = four_bit_merge_seconds(simulator)
        if round_trip:
            notes.append(
                f"weight sync: PEFT merges a 4-bit layer through the host (the bf16 weight to the CPU and back, "
                f"quantized again; unmerged the same way): {round_trip:.1f} s at {PAGEABLE_GBPS:g} GB/s, pageable "
                "copies (9-16 GB/s measured on the H200: up to 1.8x more)"
            )
        if plan.how.colocated:
            sync = (2 * base_weights + merges) / bandwidth + round_trip
        else:
            sync = merges / bandwidth + base_weights / (device.peer_gbps * 1e9) + round_trip
            notes.append("the server's GPUs timed as this one")
        if waves > 1:
            notes.append(f"vLLM's KV cache holds {concurrent} of the {plan.rows} rows at once: {waves} waves")
    scoring = step_seconds * scoring_share * micro_batches
    training = step_seconds * (1 - scoring_share) * micro_batches
    return CycleTime(prefill, low, high, sync, scoring, training, steps, host_bound, waves, notes)


def hold_generation(plan: GenerationPlan, simulator, mode: str, memory: int | None, granularity: int,
                    seq_len: int) -> None:  # fmt: skip
    """transformers' generate simulated again at the length it answers (on `memory` bytes) or, with
    no memory given, at `seq_len`: its peak there as simulated, not extrapolated from the short run
    (`simulator.generation.held_at_the_answer`). vLLM's answers do not use generate's peak."""
    from hf_offload.tools.simulator.generation import held_at_the_answer, probed

    if plan.how.use_vllm:
        return
    if memory is None:
        plan.simulated = probed(simulator, mode, plan.simulated, seq_len)
        return
    cap, _ = plan.length_cap()
    budget = memory - plan.resident - plan.workspace
    plan.simulated = held_at_the_answer(simulator, mode, plan.simulated, budget, granularity=granularity, cap=cap)
