"""The memory simulator (`hf_offload.tools.simulator`): real training steps on the meta device.

It is held to the peaks measured on one H200, to real allocations on the CPU, and to the
engine's own decisions on real tensors; each place where it must name what a GPU would do has a
companion showing the simulation goes wrong without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings

import pytest
import torch
from conftest import tiny_model
from transformers import AutoConfig

import hf_offload
from hf_offload import auto_budget
from hf_offload.engine import offloader, recompute
from hf_offload.tools import measured
from hf_offload.tools.allocations import peak_allocated
from hf_offload.tools.benchmarks import time_model
from hf_offload.tools.devices import DEVICES, TIME_MODEL, Device, TimeModel, fit_time_model
from hf_offload.tools.presets import preset_config
from hf_offload.tools.simulator import (
    MemoryTracker,
    Peak,
    Simulator,
    StepResult,
    Training,
    composition,
    memo,
    stand_ins,
)
from hf_offload.tools.simulator import step as step_module
from hf_offload.tools.simulator.search import LONGEST, longest_sequence, predict_longest

GIB = 2**30

# Peak allocated device memory (torch.cuda.max_memory_allocated, GiB) measured on one NVIDIA H200:
# (model, LoRA rank, mode, tokens) -> GiB, from the run's file (hf_offload/tools/measured/).
H200_PEAKS_GIB = measured.peaks_gib()

_SIMULATORS: dict[tuple, Simulator] = {}
_H200_STEPS: dict[tuple, StepResult] = {}


def simulator(preset: str, lora_rank: int | None, **training) -> Simulator:
    """One model per shape and training setup for the whole session: building takes seconds."""
    key = (preset, lora_rank, tuple(sorted(training.items())))
    if key not in _SIMULATORS:
        _SIMULATORS[key] = Simulator(preset_config(preset), Training(lora_rank=lora_rank, **training))
    return _SIMULATORS[key]


@pytest.fixture(autouse=True)
def quiet():
    # transformers says once that checkpointing turns the cache off; the engine that the CPU has
    # no accelerator. Both are what the simulation does on purpose.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.mark.parametrize("case", list(H200_PEAKS_GIB), ids=lambda case: "-".join(map(str, case)))
def test_simulated_peak_within_half_a_percent_of_the_h200(case):
    """All 20 agree within 0.1% (docs/estimate.md); 0.5% leaves room for the two decimals of the
    smallest measured figures (8.32 GiB is +-0.06%), not for a missing part."""
    result = h200_step(case)
    assert result.peak_bytes / GIB == pytest.approx(H200_PEAKS_GIB[case], rel=0.005)


def h200_step(case: tuple) -> StepResult:
    """A step measured on the H200, simulated once per session (the peaks' and times' tests)."""
    if case not in _H200_STEPS:
        preset, lora_rank, mode, seq_len = case
        _H200_STEPS[case] = simulator(preset, lora_rank).run(mode, seq_len)
    return _H200_STEPS[case]


def held_out_errors() -> dict[tuple, float]:
    points = measured.step_seconds()
    predicted = time_model.held_out({case: h200_step(case) for case in points}, points)
    return {case: predicted[case] / seconds - 1 for case, seconds in points.items()}


def test_time_model_predicts_each_h200_step_from_the_other_nine():
    """The ten step times measured on the H200, each predicted by the time model fitted to the
    other nine (FLOPs at their dtype's rate, attention as the kernel computes it, the memory-bound
    ops' bytes): within 7.5% (the worst, Llama-3-8B at 32k, is 7.1% over), not only as a fit."""
    errors = held_out_errors()
    assert len(errors) == 10
    assert max(abs(error) for error in errors.values()) <= 0.075


def test_the_held_out_check_catches_a_model_without_the_memory_bound_ops(monkeypatch):
    """Companion: a model of FLOPs alone (the casts, norms, activations and copies taking no time)
    fits the ten points far worse held out: more than 7.5% off."""
    parts = TimeModel.parts
    monkeypatch.setattr(TimeModel, "parts", lambda *args, **kwargs: (*parts(*args, **kwargs)[:2], 0.0))
    assert max(abs(error) for error in held_out_errors().values()) > 0.075


def test_the_time_model_in_use_is_the_fit_to_the_h200():
    points = measured.step_seconds()
    fitted = fit_time_model([(time_model.parts(h200_step(case)), seconds) for case, seconds in points.items()])
    assert (TIME_MODEL.matmul, TIME_MODEL.attention, TIME_MODEL.memory) == pytest.approx(
        (fitted.matmul, fitted.attention, fitted.memory), abs=0.01
    )


def test_half_a_percent_catches_a_missing_workspace(monkeypatch):
    """Companion: without cuBLAS's two 32 MiB workspaces (the one term inferred from these peaks),
    the smallest measured peak is 0.75% off: outside 0.5%, inside the 2% held before."""
    case = ("llama-3.2-1b", None, "checkpointing+hf_offload", 4096)
    monkeypatch.setattr(Device, "workspace_bytes", property(lambda device: 0))
    simulated = simulator(*case[:2]).run(*case[2:]).peak_bytes / GIB
    assert simulated != pytest.approx(H200_PEAKS_GIB[case], rel=0.005)
    assert simulated == pytest.approx(H200_PEAKS_GIB[case], rel=0.02)


# -- real scale: what the README claims, at 8B ---------------------------------------------------


def test_offloaded_checkpointing_saves_exactly_what_it_moves_at_8b():
    """Llama-3-8B, LoRA r=16, 32k tokens: checkpointing + hf_offload peaks lower than
    checkpointing alone by exactly the checkpoint inputs it moved to the host: those of layers
    0-30 (layer 0's is the embeddings' output that checkpointing makes require grad, taken
    detoured so that it moves too)."""
    sim = simulator("llama-3-8b", 16)
    alone, offloaded = sim.run("checkpointing", 32768), sim.run("checkpointing+hf_offload", 32768)
    layer_input = 32768 * 4096 * 2
    assert offloaded.offloaded_bytes == 31 * layer_input
    assert offloaded.offload_stats["kept_bytes"]["leaf"] == 0
    assert alone.peak_bytes - offloaded.peak_bytes == offloaded.offloaded_bytes
    assert offloaded.host_bytes == offloaded.offloaded_bytes  # 256 MiB copies fill their pooled buffers


AUTO_DEVICE = 68 * GIB  # between checkpointing + hf_offload (63.2 GiB) and checkpointing alone (70.7 GiB)


def test_auto_budget_keeps_the_8b_step_on_a_smaller_device():
    """max_device_bytes="auto" at 8B, 32k tokens, on a device checkpointing alone overflows: it
    keeps some layers on the device and the step stays under the device's memory."""
    sim = simulator("llama-3-8b", 16, device_memory_bytes=AUTO_DEVICE)
    result = sim.run("checkpointing+hf_offload_auto", 32768)
    assert result.peak_bytes <= AUTO_DEVICE
    assert 0 < result.layers_kept_for_budget < 31


def test_auto_budget_check_catches_a_budget_that_forgets_the_loss_head(monkeypatch):
    """Companion: with the loss head's reservation gone, "auto" plans the layers into memory the
    loss head needs, and the same step overflows the device."""
    monkeypatch.setattr(auto_budget, "predicted_step_bytes", lambda *args, **kwargs: 0)
    sim = simulator("llama-3-8b", 16, device_memory_bytes=AUTO_DEVICE)
    assert sim.run("checkpointing+hf_offload_auto", 32768).peak_bytes > AUTO_DEVICE


# -- the simulation against real tensors ----------------------------------------------------------


def tiny_simulator(lora_rank=None, **config) -> Simulator:
    model = tiny_model(attn_implementation="eager", **config)
    return Simulator(model.config, Training(dtype=torch.float32, lora_rank=lora_rank, lora_dtype=torch.float32))


# (mode, LoRA rank, tokens, batch, padded, autocast, tile, MLP width): each simulated and run for
# real on the CPU. A tiny Llama in float32 with eager attention (no kernel whose CPU and CUDA
# versions allocate differently), a vocabulary of 64 words so that, as on a GPU at long contexts,
# the layers and not the loss head hold the tiled steps' peaks; MLPs 1024 wide where the peak is
# to be in them, as with mixed precision, whose casts are there.
CPU_STEPS = {
    "none": ("none", None, 256, 1, False, None, None, 256),
    "checkpointing": ("checkpointing", None, 256, 1, False, None, None, 256),
    "tiled-in-a-layer-recompute": ("checkpointing+tiled", 4, 1024, 1, False, None, 128, 256),
    "tiled-without-checkpointing": ("none+tiled", 4, 1024, 1, False, None, 128, 256),
    "mixed-precision-lora": ("none", 4, 256, 1, False, torch.bfloat16, None, 1024),
    "mixed-precision-full-checkpointing": ("checkpointing", None, 256, 1, False, torch.bfloat16, None, 1024),
    "mixed-precision-full-tiled": ("checkpointing+tiled", None, 1024, 1, False, torch.bfloat16, 128, 256),
    "padded-batch": ("checkpointing", 4, 256, 2, True, None, None, 256),
    "padded-batch-tiled": ("none+tiled", 4, 512, 2, True, None, 128, 256),
}


@pytest.mark.parametrize("case", list(CPU_STEPS))
def test_simulated_peak_matches_real_cpu_allocations(case):
    """The simulated peak over the weights equals what torch's profiler counts the CPU allocator
    holding at its peak in the same step on real tensors (within 1%): tiled steps that peak in a
    layer's recompute or backward, float32 weights under bfloat16 autocast (the Trainer's
    bf16=True; CPU autocast casts these ops as CUDA's does), a batch of two with padding (the
    attention mask masks the second row's last quarter)."""
    mode, lora_rank, seq, batch_size, padded, autocast, tile, width = CPU_STEPS[case]
    config = dict(vocab_size=64, intermediate_size=width, max_position_embeddings=2048)
    training = Training(dtype=torch.float32, lora_rank=lora_rank, lora_dtype=torch.float32, batch_size=batch_size,
                        padded=padded, autocast=autocast, tile_tokens=tile)  # fmt: skip
    sim = Simulator(tiny_model(attn_implementation="eager", **config).config, training)
    simulated = sim.run(mode, seq)
    model = tiny_model(attn_implementation="eager", **config)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear"))
    base = model.get_base_model() if lora_rank is not None else model
    if mode.startswith("checkpointing"):
        base.activation_checkpointing_enable()
    if mode.endswith("+tiled"):
        hf_offload.enable_sequence_tiling(base, tile_tokens=tile)
    ids = torch.randint(64, (batch_size, seq))
    inputs = dict(input_ids=ids, labels=ids)
    if padded:
        mask = torch.ones_like(ids)
        mask[-1, -seq // 4 :] = 0
        inputs.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    def step():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(**inputs).loss
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)

    # Tiling keeps the CPU generator's state per slice (5 KiB each), in host memory on a GPU: not
    # the device's, and not simulated; the CPU's allocator counts it with the rest.
    measured, _ = peak_allocated(step, ignore_bytes=torch.get_rng_state().nbytes)
    if "tiled" in case:
        assert simulated.peak.tag[1].startswith("layer")  # where a long context's tiled step peaks
    assert simulated.tracked_peak_bytes - sim.resident_bytes == pytest.approx(measured, rel=0.01)


def test_mixed_precision_check_catches_a_simulation_without_autocast(monkeypatch):
    """Companion: without `autocast_as_on_cuda` the float32 model runs in float32 (meta tensors know
    no autocast), and the same steps' simulated peaks miss the real ones by more than 1%."""
    monkeypatch.setattr(step_module, "autocast_as_on_cuda", lambda *args: contextlib.nullcontext())
    for case in ("mixed-precision-lora", "mixed-precision-full-checkpointing"):
        with pytest.raises(AssertionError, match="comparison failed"):
            test_simulated_peak_matches_real_cpu_allocations(case)


def _query(heads=8, kv_heads=8, seq=64, head_dim=128, dtype=torch.bfloat16, grad=True):
    query = torch.empty(1, heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=grad)
    key = torch.empty(1, kv_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=grad)
    return query, key, key


@pytest.mark.parametrize(
    "case,expected",
    [
        ((dict(), None, 0.0, (9, 0)), "flash"),
        ((dict(kv_heads=2), None, 0.0, (9, 0)), "flash"),  # grouped-query attention
        ((dict(), "mask", 0.0, (9, 0)), "efficient"),  # a padding or sliding-window mask
        ((dict(dtype=torch.float32), None, 0.0, (9, 0)), "efficient"),
        ((dict(head_dim=208), None, 0.0, (8, 9)), "efficient"),  # no flash backward on sm89
        ((dict(head_dim=208, grad=False), None, 0.0, (8, 9)), "flash"),  # forward only: flash runs
        ((dict(head_dim=256), None, 0.0, (8, 9)), "flash"),
        ((dict(head_dim=256), None, 0.1, (8, 9)), "efficient"),  # above 224 only without dropout
        ((dict(head_dim=208), None, 0.0, (8, 0)), "flash"),  # sm80 has the kernel
        ((dict(head_dim=320), None, 0.0, (9, 0)), "efficient"),
        ((dict(head_dim=102, dtype=torch.float32), None, 0.0, (9, 0)), "math"),  # not a multiple of 4
    ],
)
def test_sdpa_kernel_as_cuda_dispatches(case, expected):
    """PyTorch's choice (sdp_utils.cpp, flash first) by dtype, mask, head dimension, dropout and
    compute capability."""
    shape, mask, dropout, capability = case
    query, key, value = _query(**shape)
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool, device="meta") if mask else None
    with torch.set_grad_enabled(True):
        assert stand_ins.sdpa_kernel(query, key, value, mask, dropout, mask is None, capability) == expected


def test_a_device_without_flash_backward_for_the_head_dimension_runs_the_memory_efficient_kernel():
    """Head dimension 208 in training: flash on an H100 (sm90), the memory-efficient kernel on an
    RTX 4090 (sm89), whose backward saves a float32 log-sum-exp padded to 32 rows instead of
    flash's and allocates no workspace of flash's."""
    config = tiny_model(hidden_size=416, num_attention_heads=2, num_key_value_heads=2, head_dim=208).config
    choose = stand_ins.sdpa_kernel
    chosen, peaks = {}, {}
    for name in ("h100-80gb", "rtx4090"):
        kernels = []

        def recorded(*args, kernels=kernels):
            kernels.append(choose(*args))
            return kernels[-1]

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(stand_ins, "sdpa_kernel", recorded)
            peaks[name] = Simulator(config, Training(device=DEVICES[name])).run("none", 512).tracked_peak_bytes
        chosen[name] = set(kernels)
    assert chosen == {"h100-80gb": {"flash"}, "rtx4090": {"efficient"}}
    assert peaks["h100-80gb"] != peaks["rtx4090"]


def test_a_sliding_window_costs_the_attention_kernel_the_whole_square():
    """With SDPA, transformers builds a sliding window as a mask once the sequence is longer than
    the window: the memory-efficient kernel then computes every block of the square, twice what
    a causal kernel computes, and the time model counts that (and the mask's memory); within the
    window no mask exists and the causal kernel runs."""
    window, seq = 256, 1024
    attention = {}
    for name, sliding in (("window", window), ("none", None)):
        config = tiny_model("mistral", sliding_window=sliding, max_position_embeddings=4096).config
        step = Simulator(config, Training()).run("none", seq)
        attention[name] = sum(flops for (kind, _dtype), flops in step.compute.items() if kind == "attention")
        assert step.attention_flops > 0
    assert attention["window"] == pytest.approx(2 * attention["none"])


def test_flops_are_timed_at_their_dtypes_rate():
    """A float32 matmul (PEFT's float32 adapters) takes the float32 rate, not the bf16 one."""
    device = DEVICES["h100-80gb"]
    flops = 1e15
    bf16 = TIME_MODEL.compute_seconds(device, {("matmul", torch.bfloat16): flops})
    fp32 = TIME_MODEL.compute_seconds(device, {("matmul", torch.float32): flops})
    assert fp32 / bf16 == pytest.approx(device.tflops / device.fp32_tflops)
    assert fp32 > 10 * bf16


def test_a_padded_batch_takes_a_sequence_square_mask():
    """With SDPA, padding makes transformers build a (batch, 1, seq, seq) mask and the kernel take
    it (the memory-efficient kernel, with the mask as an additive bias in bfloat16, saved for
    backward by every layer): what padding adds to the peak grows with the square of the
    sequence. Unpadded, no mask exists and flash attention runs."""
    config = tiny_model().config
    extra = {}
    for seq in (512, 1024):
        peaks = [Simulator(config, Training(batch_size=2, padded=padded)).run("none", seq).peak_bytes
                 for padded in (False, True)]  # fmt: skip
        extra[seq] = peaks[1] - peaks[0]
    square = 2 * 1024 * 1024 * 2  # one bias of two rows at 1024 tokens, bfloat16
    assert extra[1024] >= config.num_hidden_layers * square
    assert extra[1024] == pytest.approx(4 * extra[512], rel=0.05)


@pytest.mark.parametrize("mode", ["hf_offload", "checkpointing+hf_offload"])
def test_the_engine_decides_on_meta_tensors_as_on_real_ones(mode):
    """What hf_offload offloads and keeps, tensor by tensor and byte by byte, is the same in the
    simulation as in the same step on real CPU tensors (simulate_on_cpu=True)."""
    seq = 256
    simulated = tiny_simulator(lora_rank=4).run(mode, seq).offload_stats
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(attn_implementation="eager"), LoraConfig(r=4, target_modules="all-linear"))
    if mode.startswith("checkpointing"):
        model.get_base_model().activation_checkpointing_enable()
    hf_offload.enable_activation_offloading(model, simulate_on_cpu=True)
    ids = torch.randint(model.config.vocab_size, (1, seq))
    model(input_ids=ids, labels=ids).loss.backward()
    real = hf_offload.activation_offloading_stats(model).as_dict()
    for field in ("offloaded_tensors", "offloaded_bytes", "kept_tensors", "kept_bytes", "layers_offloaded"):
        assert simulated[field] == real[field], field


def test_the_engine_check_catches_storages_told_apart_by_address(monkeypatch):
    """Companion: meta storages have no address (data_ptr() is 0). Told apart by address alone,
    every activation shares its key with the parameters, and the engine keeps them all as such."""
    real = tiny_simulator(lora_rank=4).run("hf_offload", 256).offload_stats
    monkeypatch.setattr(recompute, "storage_key", lambda storage: storage.data_ptr())
    blinded = tiny_simulator(lora_rank=4).run("hf_offload", 256).offload_stats
    assert real["offloaded_tensors"] > 0 and blinded["offloaded_tensors"] == 0
    assert blinded["kept_tensors"]["parameter"] > real["kept_tensors"]["parameter"]


def test_peak_composition_adds_up_and_names_the_checkpoint_inputs():
    """Llama-3.2-1B, checkpointing, 16k tokens: the parts of the peak add up to it, and the
    checkpoint inputs still on the device at the loss head are the outputs of layers 0-14 (the
    inputs of layers 1-15), one 64 MiB hidden state each."""
    result = simulator("llama-3.2-1b", None).run("checkpointing", 16384)
    parts = composition(result.peak)
    assert sum(part.bytes for part in parts) == result.tracked_peak_bytes
    inputs = next(part for part in parts if part.phase == "forward" and part.what == "layers 0-14")
    assert inputs.layers == 15 and inputs.bytes == 15 * 16384 * 2048 * 2
    assert result.peak.tag == ("backward", "loss") and result.peak.node == "LogSoftmaxBackward0"


# -- where the simulation must be told what a GPU does --------------------------------------------


def test_without_real_device_masking_the_meta_step_cannot_decide_packing(monkeypatch):
    """Companion of `real_device_masking`: transformers asks the position ids whether sequences
    are packed, and a meta tensor has no data to answer with."""
    sim = tiny_simulator()
    monkeypatch.setattr(step_module, "real_device_masking", lambda **kwargs: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="meta"):
        sim.run("checkpointing", 128)


def test_without_an_answer_on_padding_the_meta_step_cannot_decide_the_mask(monkeypatch):
    """Companion of `real_device_masking(padded=...)`: given an attention mask, transformers asks it
    whether any position is padding, and a meta tensor has no data to answer with."""
    from transformers import masking_utils

    @contextlib.contextmanager
    def packing_only(padded):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
            yield

    monkeypatch.setattr(step_module, "real_device_masking", lambda padded: packing_only(padded))
    with pytest.raises(RuntimeError, match="meta"):
        Simulator(tiny_model().config, Training(batch_size=2, padded=True)).run("none", 128)


def test_attention_runs_the_cuda_kernel_and_not_the_math_path(monkeypatch):
    """In bf16 with transformers' SDPA attention, the simulated step runs flash attention and holds
    no attention weights; without `attention_as_on_cuda`, SDPA on meta tensors takes the math path
    and holds at least one heads x seq x seq matrix more."""
    seq = 512
    sim = Simulator(tiny_model().config, Training(dtype=torch.bfloat16))  # sdpa, as from_config picks
    on_cuda = sim.run("none", seq)
    assert on_cuda.attention_flops > 0
    monkeypatch.setattr(step_module, "attention_as_on_cuda", contextlib.nullcontext)
    math = sim.run("none", seq)
    heads = sim.config.num_attention_heads
    assert math.attention_flops == 0
    assert math.peak_bytes - on_cuda.peak_bytes >= heads * seq * seq * 2


def test_fused_loss_stand_in_allocates_what_liger_does_and_never_the_logits():
    """Liger 0.8.5's forward, read from its code: the input's gradient, the weight's (when it
    trains), the per-token loss and mask, and one reused buffer of chunk x vocab logits."""
    tokens, hidden, vocab = 4096, 64, 1000
    tracker = MemoryTracker()
    with torch.device("meta"):
        inputs = torch.empty(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16))
        target = torch.zeros(tokens, dtype=torch.long)
        for tensor in (inputs, weight, target):
            tracker.adopt(tensor)  # made before: their views are not allocations
        before = tracker.live
        with tracker:
            tracker.start(trace=False)
            loss, *_ = stand_ins.SimulatedFusedLinearCrossEntropy.apply(inputs, weight, target)
            peak = tracker.finish().bytes - before
    chunk = 256  # next_power_of_2(ceil(4096 / ceil(1000 / 64)))
    expected = tokens * hidden * 2 + vocab * hidden * 2 + tokens * 4 + tokens + chunk * vocab * 2
    assert peak == expected
    assert peak < tokens * vocab * 2  # the full bf16 logits alone would be more


def test_fused_loss_stand_in_refuses_real_tensors():
    with pytest.raises(RuntimeError, match="meta tensors only"):
        stand_ins.SimulatedFusedLinearCrossEntropy.apply(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4).long())


def test_liger_mode_runs_ligers_forward_with_the_stand_in():
    """`+liger` simulates Liger's own causal-LM forward (its loss through the stand-in): the peak
    falls, and no vocabulary-wide float32 tensor is live at it."""
    pytest.importorskip("liger_kernel")
    seq, vocab = 1024, 8192
    sim = Simulator(tiny_model(vocab_size=vocab).config, Training(dtype=torch.bfloat16))
    standard, fused = sim.run("checkpointing", seq), sim.run("checkpointing+liger", seq)
    assert standard.peak.tag == ("backward", "loss")  # transformers' loss head holds the peak
    assert fused.peak_bytes < standard.peak_bytes
    head = sum(part.bytes for part in composition(fused.peak) if part.what == "loss head")
    assert head < seq * vocab * 4


# -- the fast path: tiled slices learnt once and replayed, against every slice run -----------------

# Small enough for a second per step, with a vocabulary small enough and MLPs wide enough for the
# layers to hold the peak; 2048 tokens in slices of 512.
_SMALL = dict(hidden_size=64, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=4096)  # fmt: skip


def _gemma3n():
    """Layers that differ where their shapes do not: layers 0 and 2 compute their MLP with
    activation sparsity (a Gaussian top-k: more ops and bytes), 1 and 3 without, and sliding-window
    and global attention alternate."""
    return AutoConfig.for_model(
        "gemma3n_text", **_SMALL, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8, laurel_rank=4,
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0, 0.95, 0.0],
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128,
    )  # fmt: skip


def _qwen2_moe():
    """A dense MLP in layer 0, MoE blocks after, whose routers record their logits (transformers'
    output capturing): calls a replay cannot repeat, so the blocks run for real."""
    return AutoConfig.for_model(
        "qwen2_moe", **_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, mlp_only_layers=[0], output_router_logits=True,
    )  # fmt: skip


FAST_AND_FULL = {
    "llama-lora-checkpointing+hf_offload+tiled": (
        lambda: AutoConfig.for_model("llama", **_SMALL), dict(lora_rank=4), "checkpointing+hf_offload+tiled"),
    "llama-full-adamw-batch-2-hf_offload+tiled": (
        lambda: AutoConfig.for_model("llama", **_SMALL), dict(optimizer_states=2, batch_size=2), "hf_offload+tiled"),
    "llama-lora-checkpointing+liger+tiled": (
        lambda: AutoConfig.for_model("llama", **_SMALL), dict(lora_rank=4), "checkpointing+liger+tiled"),
    "gemma3n-alternating-layers-checkpointing+hf_offload+tiled": (
        _gemma3n, dict(lora_rank=4), "checkpointing+hf_offload+tiled"),
    "qwen2_moe-dense-first-batch-2-none+tiled": (_qwen2_moe, dict(lora_rank=4, batch_size=2), "none+tiled"),
    "llama-full-float32-under-bf16-autocast-checkpointing+tiled": (
        lambda: AutoConfig.for_model("llama", **_SMALL), dict(dtype=torch.float32, autocast=torch.bfloat16),
        "checkpointing+tiled"),
}  # fmt: skip


def fast_and_full(case: str) -> tuple[StepResult, StepResult, memo.SliceMemo]:
    make_config, options, mode = FAST_AND_FULL[case]
    if "liger" in mode:
        pytest.importorskip("liger_kernel")
    training = Training(**{"dtype": torch.bfloat16, "tile_tokens": 512, **options})
    fast, full = Simulator(make_config(), training), Simulator(make_config(), training, replay=False)
    return fast.run(mode, 2048), full.run(mode, 2048), fast.memo


@pytest.mark.parametrize("case", list(FAST_AND_FULL))
def test_replayed_slices_give_the_full_simulation(case):
    """What the estimates rest on: a step whose tiled slices are learnt once and replayed holds the
    same peak, made of the same parts, at the same op, and counts the same FLOPs and traffic as
    the step that runs every slice. Exact, where 0.5% is what the issue allows; in the MoE case
    the blocks that record their routers' logits run for real by themselves, and under autocast
    every call does."""
    fast, full, learnt = fast_and_full(case)
    autocast = "autocast" in case  # its cache of casts outlives a call: calls under it run for real
    assert (learnt.replays > 0) != autocast  # the loss head's backward slices recompute under autocast too
    assert (learnt.real_calls > 0) == (case.startswith("qwen2_moe") or autocast)
    assert fast.peak_bytes == full.peak_bytes
    assert fast.peak.live_by_tag == full.peak.live_by_tag
    assert (fast.peak.op, fast.peak.tag) == (full.peak.op, full.peak.tag)
    assert (fast.matmul_flops, fast.attention_flops, fast.traffic_bytes) == (
        full.matmul_flops, full.attention_flops, full.traffic_bytes)  # fmt: skip
    assert fast.flops_by_tag == full.flops_by_tag


def test_the_comparison_catches_a_replay_keyed_on_what_a_module_looks_like(monkeypatch):
    """Companion: keyed on a module's class, parameter shapes and place in its layer instead of the
    instance, Gemma 3n's sparse MLPs and its dense ones share what was learnt, and the peak moves
    off the full simulation's by more than 0.5%, the traffic too."""

    def structural(module, args, kwargs, grad, tag):
        looks = (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))
        where = tuple(re.sub(r"layer \d+", "layer *", str(part)) for part in tag)
        return (looks, grad, memo._describe(args), memo._describe(kwargs), memo._autocast_state(), where)

    monkeypatch.setattr(memo, "call_key", structural)
    fast, full, _learnt = fast_and_full("gemma3n-alternating-layers-checkpointing+hf_offload+tiled")
    assert abs(fast.peak_bytes / full.peak_bytes - 1) > 0.005
    assert fast.traffic_bytes != full.traffic_bytes


def _final_norm_fast_and_full(loss: bool):
    """Every part tiled, the final norm chained into the tiled loss head (`loss`) or tiled on its
    own (the loss untiled, as under TRL's or Liger's heads): the memo's step and the full one."""
    from hf_offload.internal import find_final_norm, resolve_layers

    tiling = dict(mlp=True, norms=True, projections=True, attention=True, loss=loss)
    training = Training(dtype=torch.bfloat16, lora_rank=4, tile_tokens=512, tiling=tiling)
    fast = Simulator(AutoConfig.for_model("llama", **_SMALL), training)
    full = Simulator(AutoConfig.for_model("llama", **_SMALL), training, replay=False)
    mode = "checkpointing+hf_offload+tiled"
    norm = find_final_norm(fast.base, resolve_layers(fast.base)[1])
    return fast.run(mode, 2048), full.run(mode, 2048), fast.memo.replays_by_module.get(id(norm), 0)


@pytest.mark.parametrize("loss", [True, False], ids=["chained-into-the-loss-head", "tiled-on-its-own"])
def test_the_final_norms_slices_are_replayed_and_give_the_full_simulation(loss):
    """The final norm is tiled as a per-token module wherever it runs, and chained into the tiled
    loss head where lm_head takes its output: its slices are learnt once and replayed like the
    layers' parts, and the step is exactly the one that runs every slice."""
    fast, full, norm_replays = _final_norm_fast_and_full(loss)
    assert norm_replays >= 2048 // 512  # at least one replay per slice
    assert fast.peak_bytes == full.peak_bytes and fast.peak.live_by_tag == full.peak.live_by_tag
    assert (fast.peak.op, fast.peak.tag) == (full.peak.op, full.peak.tag)
    assert (fast.traffic_bytes, fast.flops_by_tag) == (full.traffic_bytes, full.flops_by_tag)


def test_the_final_norm_comparison_catches_a_replay_that_drops_its_counts(monkeypatch):
    """Companion: a memo whose replays of the final norm forget what they count (the float32 norm's
    casts and products: traffic, no FLOPs) is caught by the same comparison."""
    replay_forward = memo.SliceMemo._replay_forward

    def forgetful(self, learnt):
        if learnt.forward.tag[1:2] == ("norm",):
            learnt = dataclasses.replace(learnt, forward=dataclasses.replace(learnt.forward, counts=memo.Account()))
        return replay_forward(self, learnt)

    monkeypatch.setattr(memo.SliceMemo, "_replay_forward", forgetful)
    fast, full, norm_replays = _final_norm_fast_and_full(loss=True)
    assert norm_replays > 0 and fast.traffic_bytes < full.traffic_bytes


# -- the longest-context pieces: each lowers the peak where its part holds it ----------------------

# 4096 tokens in slices of 256, GQA. Narrow layers: attention's backward holds the peak, the first
# layers' inputs and the embeddings' output around it. Wider ones: the final norm's backward does.
_PIECES_NARROW = dict(hidden_size=64, intermediate_size=256)
_PIECES_WIDE = dict(hidden_size=256, intermediate_size=512)
_WHERE_EACH_PIECE_MATTERS = {
    "heads": _PIECES_NARROW, "embeddings": _PIECES_NARROW, "late_prefetch": _PIECES_NARROW,
    "final_norm": _PIECES_WIDE,
}  # fmt: skip


@pytest.mark.parametrize("piece", sorted(_WHERE_EACH_PIECE_MATTERS))
def test_each_longest_context_piece_lowers_the_peak_where_its_part_holds_it(piece, monkeypatch):
    """The ladder in docs/longest_context.md, one piece at a time: with every other piece on,
    turning this one off raises the simulated peak (attention tiled over heads, the final norm
    with the loss head, the embeddings' output offloaded, the layer before back after the peak)."""
    from hf_offload.internal import longest_context_pieces

    monkeypatch.setattr(offloader, "LATE_PREFETCH_BYTES", 0)  # its threshold is 256 MiB a layer
    config = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=64,
                  max_position_embeddings=8192, **_WHERE_EACH_PIECE_MATTERS[piece])  # fmt: skip
    peaks = {}
    for on in (True, False):
        with longest_context_pieces(**{piece: on}):
            simulator = Simulator(AutoConfig.for_model("llama", **config), Training(lora_rank=4, tile_tokens=256))
            peaks[on] = simulator.run("checkpointing+hf_offload+tiled", 4096).peak_bytes
    assert peaks[False] > peaks[True]


# -- the longest sequence --------------------------------------------------------------------------


def stepped(seq_len: int, peak: int, trace: list[int] | None = None) -> StepResult:
    return StepResult("m", seq_len, 1, peak, 0, Peak(bytes=peak), trace=trace)


def test_per_op_lines_predict_the_longest_length_exactly():
    """Two runs of the same ops: op 0 holds 100 + 1 per token, op 1 holds 10 + 3 per token. With
    1000 bytes, op 1 allows 330 tokens and op 0 900: 330."""
    short = stepped(10, 40, trace=[110, 40])
    long_ = stepped(20, 70, trace=[120, 70])
    assert predict_longest(short, long_, 1000) == 330
    # One line through the peaks alone would extrapolate op 1 only if it held the peak at both.
    assert predict_longest(stepped(10, 110), stepped(20, 120), 1000) == 900


def test_phase_lines_predict_where_the_ops_differ():
    """Tiled steps run more ops at longer lengths, so per-op lines do not exist. The peak's own
    line would follow the optimizer's constant peak that holds it at short lengths (flat: no
    limit); the lines of each phase and module find the layer's that grows and overtakes it."""
    short = stepped(10, 500, trace=[1] * 3)
    long_ = stepped(20, 500, trace=[1] * 4)
    short.tag_peaks = {("optimizer", ""): 500, ("backward", "layer 2"): 110}
    long_.tag_peaks = {("optimizer", ""): 500, ("backward", "layer 2"): 220}
    assert predict_longest(short, long_, 1000) == 90  # 110 + 11 per token reaches 1000 at 90
    short.tag_peaks = long_.tag_peaks = {}
    assert predict_longest(short, long_, 1000) == LONGEST


def run_with(peak_of):
    calls = []

    def run(seq_len, trace):
        calls.append(seq_len)
        peak = peak_of(seq_len)
        return stepped(seq_len, peak, trace=[peak] if trace else None)

    return run, calls


def test_bisection_confirms_a_right_prediction_with_two_runs():
    run, calls = run_with(lambda n: 1000 + 10 * n)
    found = longest_sequence(run, mode="m", memory_bytes=1000 + 10 * 5000, workspace_bytes=0, granularity=1024,
                             lengths=(1024, 2048))  # fmt: skip
    assert found.max_seq_len == 4096 and found.predicted == 5000
    assert calls == [1024, 2048, 4096, 5120]


def test_the_steps_a_search_foresees_run_together():
    """Given a way to simulate several lengths at once, the search hands it the two lengths it
    starts from, then the prediction with the grid point after it: a right prediction ends the
    search in two rounds of two steps, with the answer of the search that runs them one by one."""
    run, calls = run_with(lambda n: 1000 + 10 * n)
    batches = []

    def run_together(tasks):
        batches.append(tasks)
        return [run(n, trace) for n, trace in tasks]

    found = longest_sequence(run, mode="m", memory_bytes=1000 + 10 * 5000, workspace_bytes=0, granularity=1024,
                             lengths=(1024, 2048), run_together=run_together)  # fmt: skip
    assert found.max_seq_len == 4096 and found.predicted == 5000
    assert batches == [[(1024, True), (2048, True)], [(4096, False), (5120, False)]]
    assert calls == [1024, 2048, 4096, 5120]  # nothing simulated twice


def test_where_it_bisects_two_steps_at_once_cut_the_bracket_in_three():
    """Memory that bends past 40,000 tokens (a host budget full, later layers kept on the device):
    the search bisects, and given two steps at a time it simulates the bracket's two thirds
    together. The same answer as one step at a time, in fewer rounds."""
    peak = lambda n: 1000 + 10 * n + 200 * max(0, n - 40000)  # noqa: E731
    memory = 1000 + 10 * 100_000
    run, calls = run_with(peak)
    alone = longest_sequence(run, mode="m", memory_bytes=memory, workspace_bytes=0, lengths=(1024, 2048))
    run, paired_calls = run_with(peak)
    batches = []

    def run_together(tasks):
        batches.append(tasks)
        return [run(n, trace) for n, trace in tasks]

    paired = longest_sequence(run, mode="m", memory_bytes=memory, workspace_bytes=0, lengths=(1024, 2048),
                              run_together=run_together)  # fmt: skip
    assert paired.max_seq_len == alone.max_seq_len == 41984
    # A bracket's thirds: two steps more than a grid point apart (the prediction's pair is one apart).
    assert any(not trace and b - a > 1024 for (a, trace), (b, _) in batches)
    rounds = len(paired_calls) - sum(len(batch) for batch in batches) + len(batches)
    assert rounds < len(calls)


def test_bisection_finds_the_edge_when_the_lines_bend():
    """Memory jumps at 3000 tokens (a tensor that only then exceeds min_offload_bytes, say): the
    prediction from 1024 and 2048 is too long, and the bisection walks back to the edge."""
    run, _ = run_with(lambda n: 1000 + 10 * n + (20_000 if n >= 3000 else 0))
    found = longest_sequence(run, mode="m", memory_bytes=1000 + 10 * 5000, workspace_bytes=0, granularity=512,
                             lengths=(1024, 2048))  # fmt: skip
    assert found.max_seq_len == 2560  # 3072 holds 51720 > 51000
    assert any(p.seq_len == 3072 and not p.fits for p in found.probes)


def test_bisection_reports_nothing_fits_and_memory_that_never_grows():
    run, _ = run_with(lambda n: 10**9)
    assert longest_sequence(run, mode="m", memory_bytes=1000, workspace_bytes=0).max_seq_len is None
    run, _ = run_with(lambda n: 500)
    flat = longest_sequence(run, mode="m", memory_bytes=1000, workspace_bytes=0, granularity=1 << 20)
    assert flat.reached_limit and flat.max_seq_len == LONGEST
