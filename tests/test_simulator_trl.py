"""The simulator's TRL step (`hf_offload.tools.simulator.trl`): TRL 1.16's real fused head on the
meta device, held to real CPU allocations, and its CUDA stand-ins held to what TRL's Triton
kernels allocate (nothing: they write into the tensors they are given)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import tiny_model

import hf_offload
from hf_offload.tools.allocations import peak_allocated
from hf_offload.tools.modes import parse_mode, set_checkpointing
from hf_offload.tools.simulator import MemoryTracker, Simulator, Training, TrlStep
from hf_offload.tools.simulator import trl as trl_module

# A vocabulary of 64 words: TRL's buffer is 32,768 columns wide whatever the vocabulary, so at these
# lengths its tiles and their torch fallback's float32 temporaries hold the peak.
CONFIG = dict(vocab_size=64, intermediate_size=256, max_position_embeddings=1024)
TILE = 64

# (trainer, mode, LoRA rank, completion or sequence tokens, autocast)
CPU_STEPS = {
    "sft-full": ("sft", "none", None, 128, None),
    "sft-lora-offloaded-checkpointing": ("sft", "checkpointing+hf_offload", 4, 128, None),
    "sft-mixed-precision": ("sft", "checkpointing", 4, 128, torch.bfloat16),
    "dpo-lora-checkpointing": ("dpo", "checkpointing", 4, 96, None),
    "grpo-lora-tiled-with-reference": ("grpo", "none+tiled", 4, 192, None),
}
STEP = dict(prompt_length=16, num_generations=3, grpo_beta=0.04, old_log_probs=True)


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hf_offload").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def simulated_and_measured(case: str, kernel: str = "torch") -> tuple[int, int]:
    trainer, mode, lora_rank, seq, autocast = CPU_STEPS[case]
    step = TrlStep(trainer, kernel=kernel, **STEP)
    training = Training(dtype=torch.float32, lora_rank=lora_rank, lora_dtype=torch.float32, autocast=autocast,
                        tile_tokens=TILE, trl=step)  # fmt: skip
    sim = Simulator(tiny_model(attn_implementation="eager", **CONFIG).config, training)
    simulated = sim.run(mode, seq)
    model = tiny_model(attn_implementation="eager", **CONFIG)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear"))
    base = model.get_base_model() if lora_rank is not None else model
    parsed = parse_mode(mode)
    set_checkpointing(base, parsed.checkpointing)
    if parsed.tiled:
        hf_offload.enable_sequence_tiling(base, tile_tokens=TILE)
    if parsed.hf_offload:
        hf_offload.enable_activation_offloading(base, simulate_on_cpu=True)
    cpu_step = TrlStep(trainer, **STEP)

    def run():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = trl_module.trl_step(model, cpu_step, batch_size=1, seq_len=seq, device="cpu")
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)

    with trl_module.fused_head_added(base, trainer):
        measured, _ = peak_allocated(run, ignore_bytes=torch.get_rng_state().nbytes)
    return simulated.tracked_peak_bytes - sim.resident_bytes, measured


@pytest.mark.parametrize("case", list(CPU_STEPS))
def test_simulated_trl_step_matches_real_cpu_allocations(case):
    """TRL's step simulated with its torch fallback (what a CPU runs) holds, at its peak, what
    torch's profiler counts the CPU allocator holding in the same step on real tensors, within 1%:
    SFT, DPO's policy and reference passes, GRPO's old and reference log-probs and policy step,
    under checkpointing, offloading, tiling and bfloat16 autocast."""
    simulated, measured = simulated_and_measured(case)
    assert simulated == pytest.approx(measured, rel=0.01)


def test_the_cpu_check_tells_the_triton_path_from_the_fallback():
    """Companion: the same step simulated as on CUDA (Triton kernels, which allocate nothing) holds
    less than the CPU's fallback, whose float32 copies of the bf16 tiles the check counts: 2.4%
    apart, more than the check's 1%."""
    on_cuda, measured = simulated_and_measured("sft-mixed-precision", kernel="triton")
    assert on_cuda < measured * 0.99


def test_without_an_answer_on_autocast_trl_cannot_run_on_meta(monkeypatch):
    """Companion: TRL asks `torch.is_autocast_enabled("meta")`, which PyTorch refuses; the stand-in
    answers with the CPU's autocast, which stands for CUDA's in the simulated step."""
    import contextlib

    from hf_offload.tools.simulator import step as step_module

    original = torch.is_autocast_enabled
    for module in (trl_module, step_module):
        monkeypatch.setattr(module, "autocast_regions_on_meta", contextlib.nullcontext)
    with pytest.raises(RuntimeError, match="unknown device type for autocast"):
        simulated_and_measured("sft-mixed-precision")
    assert torch.is_autocast_enabled is original


# -- the Triton path's allocations, read from TRL's kernels ----------------------------------------

N, HIDDEN, VOCAB = 5000, 16, 70000  # two token tiles, three vocabulary tiles
CHUNK = 32768


def _head_bytes(kernel: str, dtype=torch.bfloat16) -> tuple[int, int, int]:
    """What `ChunkedLogProbFunction` adds at its peak in forward and in backward on meta tensors, and
    what stays after forward, with the stand-ins of `kernel`."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    tracker = MemoryTracker()
    with trl_module.fused_head_as_on_cuda(kernel), tracker:
        tracker.start(trace=False)
        hidden = torch.empty((N, HIDDEN), dtype=dtype, device="meta", requires_grad=True)
        weight = torch.empty((VOCAB, HIDDEN), dtype=dtype, device="meta")
        targets = torch.zeros((N,), dtype=torch.long, device="meta")
        before = tracker.live
        outputs = ("log_probs",)
        logprobs, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, CHUNK, None, 1.0, outputs)
        tracker.main.settle()
        forward_peak = tracker.peak.bytes - before
        after = tracker.live - before
        gradient = torch.ones_like(logprobs)  # contiguous, as TRL's masked_scatter gives it
        tracker.start(trace=False)
        at_backward = tracker.live
        logprobs.backward(gradient)
        backward_peak = tracker.peak.bytes - at_backward
        del gradient, logprobs, hidden
    return forward_peak, after, backward_peak


def test_the_triton_path_allocates_what_trls_kernels_do():
    """Read from trl/kernels/chunked_logprob.py: forward allocates seven float32 per-token running
    statistics and one (4096, 32768) tile buffer of the compute dtype, and keeps log Z and the
    log-probabilities; its Triton kernel writes into those. Backward allocates the float32 gradient
    of the hidden states and a tile buffer, accumulates in place (cuBLAS's fp32 out_dtype), and
    returns the gradient cast to the hidden states' dtype."""
    tile = min(N, 4096) * CHUNK * 2
    forward, kept, backward = _head_bytes("triton")
    assert forward == tile + 9 * N * 4  # 7 statistics, then log Z beside log(sum) or the log-probabilities
    assert kept == 2 * N * 4  # log Z (saved) and the log-probabilities
    assert backward == N * HIDDEN * 4 + tile + N * HIDDEN * 2


def test_the_fallback_allocates_float32_tiles_the_triton_path_does_not():
    """Companion: TRL's torch fallback upcasts each tile to float32 and builds its exponentials
    beside it; the Triton stand-in must not."""
    forward, _, backward = _head_bytes("torch")
    triton_forward, _, triton_backward = _head_bytes("triton")
    float32_tile = min(N, 4096) * CHUNK * 4
    assert forward - triton_forward >= 2 * float32_tile
    assert backward - triton_backward >= 2 * float32_tile


def test_only_the_labelled_rows_are_scored_on_the_triton_path():
    """On CUDA TRL scores `hidden[mask]`, the rows with a label; on meta the count comes from the
    step, and the gradient is put back into a tensor of the whole shape. Outside the stand-in a
    boolean mask on meta is PyTorch's error again."""
    hidden = torch.empty((2, 10, HIDDEN), device="meta", requires_grad=True)
    mask = torch.ones((2, 10), dtype=torch.bool, device="meta")
    with trl_module.fused_head_as_on_cuda("triton") as scoring:
        with pytest.raises(RuntimeError, match="tokens it keeps were not given"):
            hidden[mask]
        scoring.valid_tokens = 7
        rows = hidden[mask]
        assert rows.shape == (7, HIDDEN)
        rows.sum().backward()
        assert hidden.grad.shape == hidden.shape
    with pytest.raises(NotImplementedError):
        hidden[mask]


class _Told:
    valid_tokens = None


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_the_step_tells_the_stand_in_the_tokens_trl_scores(trainer):
    """What `trl_step` tells the stand-in before each fused call is the count of labels TRL's
    forward keeps (`labels[:, 1:] != -100`), read from the real labels on the CPU: whole rows for
    SFT, the completions of chosen and rejected rows for DPO, the completion of each micro-batch
    for GRPO's old, reference and policy passes."""
    model = tiny_model(**CONFIG)
    told, true = _Told(), []
    counts = []

    def record(module, args, kwargs):
        labels = kwargs["labels"]
        true.append(int((labels[:, 1:] != -100).sum()))
        counts.append(told.valid_tokens)

    model.register_forward_pre_hook(record, with_kwargs=True)
    step = TrlStep(trainer, **STEP)
    with trl_module.fused_head_added(model, trainer):
        trl_module.trl_step(model, step, batch_size=2, seq_len=20, device="cpu", scoring=told)
    assert counts == true
    assert len(true) == {"sft": 1, "dpo": 2, "grpo": 3}[trainer]


@pytest.mark.parametrize("old, beta, calls", [(True, 0.0, 2), (False, 0.04, 2), (False, 0.0, 1)])
def test_grpo_runs_the_passes_its_config_asks_for(old, beta, calls):
    """GRPO's no-grad passes: the old policy's when asked (vLLM's importance sampling), the
    reference's when beta is above 0; the policy step always, and only it with grad."""
    model = tiny_model(**CONFIG)
    grads = []
    model.register_forward_pre_hook(lambda module, args: grads.append(torch.is_grad_enabled()))
    step = TrlStep("grpo", prompt_length=4, num_generations=2, grpo_beta=beta, old_log_probs=old)
    with trl_module.fused_head_added(model, "grpo"):
        loss = trl_module.trl_step(model, step, batch_size=1, seq_len=8, device="cpu")
    loss.backward()
    assert grads == [False] * (calls - 1) + [True]


def test_the_simulated_defaults_are_trls():
    """TrlStep's and TrlGeneration's defaults are GRPOConfig's and DPOConfig's (TRL 1.16): beta 0,
    8 generations, transformers' generate, vLLM colocated at 0.3 of the GPU without sleep mode; the
    old log-probs computed as TRL decides with its defaults (with vLLM's importance sampling
    correction; without vLLM, generation aligned with the optimizer's steps: none)."""
    from trl import DPOConfig, GRPOConfig

    from hf_offload.tools.simulator.trl import TrlGeneration

    grpo = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], per_device_train_batch_size=8)
    step, how = TrlStep("grpo"), TrlGeneration()
    assert (step.grpo_beta, step.num_generations) == (grpo.beta, grpo.num_generations)
    assert (how.use_vllm, how.vllm_mode, how.vllm_gpu_memory_utilization, how.vllm_enable_sleep_mode) == (
        grpo.use_vllm, grpo.vllm_mode, grpo.vllm_gpu_memory_utilization, grpo.vllm_enable_sleep_mode)
    aligned = grpo.gradient_accumulation_steps % (grpo.steps_per_generation * grpo.num_iterations) == 0
    assert step.computes_old_log_probs == (not aligned or (grpo.use_vllm and grpo.vllm_importance_sampling_correction))
    with_vllm = TrlStep("grpo", generation=TrlGeneration(use_vllm=True))
    assert with_vllm.computes_old_log_probs == grpo.vllm_importance_sampling_correction
    dpo = DPOConfig(output_dir="unused", use_cpu=True, report_to=[])
    assert (TrlStep("dpo").precompute_ref_log_probs, TrlStep("dpo").sync_ref_model) == (
        dpo.precompute_ref_log_probs, dpo.sync_ref_model)
