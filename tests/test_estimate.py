"""The estimator against what the engine measures, what the CPU allocator counts, and the H200's figures."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from conftest import BATCH, SEQ, batch, enable_sim, tiny_model, train_step
from peft import LoraConfig, get_peft_model
from torch.profiler import ProfilerActivity, profile

import hf_offload
from hf_offload.tools.cli import main
from hf_offload.tools.estimate import (
    DEVICES,
    MODES,
    PRESETS,
    Shape,
    estimate,
    fixed_bytes,
    loss_head_bytes_per_token,
    max_seq_len,
    saved_bytes_per_token,
    step_peak,
    step_phases,
    step_time,
)


def measured_bytes(model_type, tuning, checkpointing, dtype):
    model = tiny_model(model_type).to(dtype)
    if tuning != "full":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        if tuning == "lora_fp32":
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
    enable_sim(model, keep_last_layers=0)
    if checkpointing:
        model.activation_checkpointing_enable()
    train_step(model, batch())
    return hf_offload.activation_offloading_stats(model).offloaded_bytes, model


CASES = [
    ("full", False, torch.float32),
    ("full", True, torch.float32),
    ("full", False, torch.bfloat16),
    ("lora", False, torch.float32),
    ("lora", True, torch.float32),
    ("lora_fp32", False, torch.bfloat16),
]


@pytest.mark.parametrize("tuning,checkpointing,dtype", CASES)
def test_predicted_bytes_within_ten_percent_of_measured(model_type, tuning, checkpointing, dtype):
    measured, model = measured_bytes(model_type, tuning, checkpointing, dtype)
    shape = Shape.from_config(model.config)
    per_token = saved_bytes_per_token(
        shape,
        dtype_bytes=2 if dtype == torch.bfloat16 else 4,
        checkpointing=checkpointing,
        lora_rank=None if tuning == "full" else 4,
        lora_dtype_bytes=4 if tuning == "lora_fp32" else None,
    )
    predicted = per_token * BATCH * SEQ * shape.layers
    assert abs(predicted - measured) <= 0.10 * measured, f"predicted {predicted}, measured {measured}"


def test_presets_and_the_known_figure_for_llama_3_8b():
    shape = PRESETS["llama-3-8b"]
    # About 49 x hidden bytes per token per layer in bf16 (full), 2 x hidden with checkpointing.
    assert saved_bytes_per_token(shape, dtype_bytes=2) == pytest.approx(49 * shape.hidden, rel=0.02)
    assert saved_bytes_per_token(shape, dtype_bytes=2, checkpointing=True) == 2 * shape.hidden
    result = estimate(shape, seq_len=8192, dtype_bytes=2)
    assert result.total_bytes == result.layer_bytes * 32
    assert result.offloaded_bytes == result.layer_bytes * 31
    assert result.saved_bytes == result.layer_bytes * 29
    assert set(PRESETS) >= {"llama-3-8b", "qwen2-7b", "mistral-7b", "gemma-7b"}


def test_copies_hide_only_when_the_link_is_fast_enough():
    shape = PRESETS["llama-3-8b"]
    assert estimate(shape, seq_len=4096, checkpointing=True, link_gbps=25, tflops=400).hides_behind_compute
    assert not estimate(shape, seq_len=4096, link_gbps=1, tflops=400).hides_behind_compute


# ---------------------------------------------------------------------------------------------
# The whole step: against the H200 and against allocations counted on the CPU
# ---------------------------------------------------------------------------------------------

# Measured on one H200, bf16, batch 1, forward + backward with gradients set to None between
# steps and no optimizer: /work/shared/measurements/h200-2026-11-30.md (also in docs/estimate.md).
# (shape, tuning, mode, tokens, peak GiB, step seconds or None)
H200 = [
    ("llama-3.2-1b", "full", "none", 4096, 14.93, 0.0864),
    ("llama-3.2-1b", "full", "none", 16384, 52.64, 0.4313),
    ("llama-3.2-1b", "full", "hf_offload", 4096, 8.72, None),
    ("llama-3.2-1b", "full", "hf_offload", 16384, 27.76, None),
    ("llama-3.2-1b", "full", "checkpointing", 4096, 8.55, 0.1043),
    ("llama-3.2-1b", "full", "checkpointing", 16384, 27.10, 0.5391),
    ("llama-3.2-1b", "full", "checkpointing+hf_offload", 4096, 8.32, None),
    ("llama-3.2-1b", "full", "checkpointing+hf_offload", 16384, 26.17, None),
    ("llama-3.2-1b", "lora", "none", 8192, 33.47, 0.2484),
    ("llama-3.2-1b", "lora", "none", 32768, 126.67, 1.3608),
    ("llama-3.2-1b", "lora", "hf_offload", 8192, 15.42, None),
    ("llama-3.2-1b", "lora", "hf_offload", 32768, 54.47, None),
    ("llama-3.2-1b", "lora", "checkpointing", 8192, 14.71, 0.3350),
    ("llama-3.2-1b", "lora", "checkpointing", 32768, 51.63, 1.8080),
    ("llama-3.2-1b", "lora", "checkpointing+hf_offload", 8192, 14.28, None),
    ("llama-3.2-1b", "lora", "checkpointing+hf_offload", 32768, 49.88, None),
    ("llama-3-8b", "lora", "checkpointing", 16384, 42.92, 2.932),
    ("llama-3-8b", "lora", "checkpointing", 32768, 70.66, 6.943),
    ("llama-3-8b", "lora", "checkpointing+hf_offload", 16384, 39.17, None),
    ("llama-3-8b", "lora", "checkpointing+hf_offload", 32768, 63.16, None),
]
# LoRA r=16 on all linears with PEFT's default fp32 adapters on the bf16 model.
H200_LORA = {"lora_rank": 16, "lora_dtype_bytes": 4}


def h200_options(tuning):
    return {"dtype_bytes": 2, "optimizer_states": 0, **(H200_LORA if tuning == "lora" else {})}


@pytest.mark.parametrize("preset,tuning,mode,tokens,gib,_", H200, ids=lambda v: str(v))
def test_step_peak_within_ten_percent_of_the_h200(preset, tuning, mode, tokens, gib, _):
    peak = step_peak(PRESETS[preset], seq_len=tokens, mode=mode, **h200_options(tuning))
    assert peak.peak_bytes / 2**30 == pytest.approx(gib, rel=0.10)
    # Every one of these runs has the standard loss head: its backward is the peak.
    assert peak.phase.name == "loss head"


@pytest.mark.parametrize("mode,measured", [("checkpointing", 1.82), ("checkpointing+hf_offload", 1.57)])
def test_llama_3_8b_slope_per_token_matches_the_h200(mode, measured):
    # The figures: 8B LoRA r=16, 16k -> 32k tokens: 42.92 -> 70.66 GiB with checkpointing,
    # 39.17 -> 63.16 GiB with checkpointing + hf_offload.
    shape = PRESETS["llama-3-8b"]
    at = {n: step_peak(shape, seq_len=n, mode=mode, **h200_options("lora")).peak_bytes for n in (16384, 32768)}
    slope = (at[32768] - at[16384]) / 16384 / 1e6
    assert slope == pytest.approx(measured, rel=0.10)
    assert step_peak(shape, seq_len=32768, mode=mode, **h200_options("lora")).per_token_bytes / 1e6 == pytest.approx(
        slope
    )


@pytest.mark.parametrize("preset,tuning,mode,tokens,_,seconds", [p for p in H200 if p[-1]], ids=lambda v: str(v))
def test_step_time_within_ten_percent_of_the_h200(preset, tuning, mode, tokens, _, seconds):
    lora = H200_LORA if tuning == "lora" else {}
    predicted = step_time(PRESETS[preset], seq_len=tokens, checkpointing=mode == "checkpointing", **lora)
    assert predicted.seconds == pytest.approx(seconds, rel=0.10)


def test_the_old_compute_line_was_three_times_too_slow_and_the_new_one_is_not():
    # The issue: the estimate said 22 s for the 8B LoRA checkpointed 32k step that took 6.9 s.
    shape = PRESETS["llama-3-8b"]
    result = estimate(shape, seq_len=32768, checkpointing=True, lora_rank=16, lora_dtype_bytes=4)
    step = step_time(shape, seq_len=32768, checkpointing=True, **H200_LORA)
    layers = shape.layers * (result.forward_compute_seconds + result.backward_compute_seconds)
    assert 5.5 < step.seconds < 8.5
    # The per-layer lines are the same FLOPs at the same rate, without lm_head and the adapters' casts.
    assert layers < step.seconds and layers == pytest.approx(step.compute_seconds, rel=0.05)


def test_a_fused_loss_moves_the_peak_from_the_loss_head_to_a_layer():
    shape = PRESETS["llama-3-8b"]
    for mode in ("checkpointing", "checkpointing+hf_offload"):
        standard = step_peak(shape, seq_len=32768, mode=mode, **H200_LORA)
        fused = step_peak(shape, seq_len=32768, mode=mode, fused_loss=True, **H200_LORA)
        assert standard.phase.name == "loss head" and fused.phase.name == "last layer backward"
        assert fused.per_token_bytes < standard.per_token_bytes / 2
    # Offloading checkpoint inputs matters most once the logits are gone.
    ckpt = step_peak(shape, seq_len=32768, mode="checkpointing", fused_loss=True, **H200_LORA)
    both = step_peak(shape, seq_len=32768, mode="checkpointing+hf_offload", fused_loss=True, **H200_LORA)
    assert both.per_token_bytes < 0.7 * ckpt.per_token_bytes


def test_full_fine_tuning_peaks_on_gradients_and_optimizer_state_until_the_sequence_is_long():
    # 8B in bf16 with AdamW: 15 GiB of weights, as much of gradients, twice that of state.
    shape = PRESETS["llama-3-8b"]
    fixed = fixed_bytes(shape)
    short = step_peak(shape, seq_len=1024, mode="checkpointing+hf_offload")
    assert short.phase.name in ("first layer backward", "optimizer step")
    assert short.peak_bytes >= fixed.total
    long = step_peak(shape, seq_len=65536, mode="checkpointing+hf_offload")
    assert long.phase.name == "loss head" and short.long_phase.name == "loss head"
    # Gradients are set to None between steps: the loss head sees none of them.
    head = next(phase for phase in long.phases if phase.name == "loss head")
    assert head.fixed_bytes == fixed.weights + fixed.optimizer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True])
def test_max_seq_len_is_the_longest_that_fits(mode, fused):
    shape = PRESETS["llama-3-8b"]
    options = {"mode": mode, "fused_loss": fused, **H200_LORA}
    memory = 80 * 2**30
    longest = max_seq_len(memory, shape, **options)
    assert longest > 0
    assert step_peak(shape, seq_len=longest, **options).peak_bytes <= memory
    assert step_peak(shape, seq_len=longest + 1, **options).peak_bytes > memory
    assert max_seq_len(memory, shape, batch_size=2, **options) == longest // 2


def test_max_seq_len_is_zero_when_the_weights_alone_do_not_fit():
    shape = PRESETS["llama-3-8b"]
    assert fixed_bytes(shape).weights > 10 * 2**30
    assert max_seq_len(10 * 2**30, shape, mode="checkpointing+hf_offload", fused_loss=True) == 0


def test_fixed_part_counts_the_known_parameter_numbers():
    assert PRESETS["llama-3-8b"].parameters == pytest.approx(8.03e9, rel=0.005)
    assert PRESETS["llama-3.2-1b"].parameters == pytest.approx(1.236e9, rel=0.005)
    # PEFT's LoRA r=16 on all linears of Llama-3-8B: 41.9M trainable parameters.
    assert PRESETS["llama-3-8b"].lora_parameters(16) == 41_943_040
    adamw = fixed_bytes(PRESETS["llama-3-8b"], lora_rank=16, lora_dtype_bytes=4)
    assert adamw.gradients == 41_943_040 * 4 and adamw.optimizer == 2 * adamw.gradients
    assert fixed_bytes(PRESETS["llama-3-8b"], optimizer_states=0).optimizer == 0


@pytest.mark.parametrize(
    "call,fragment",
    [
        (lambda s: step_phases(s, mode="fast"), "mode must be one of none, hf_offload, checkpointing"),
        (lambda s: max_seq_len(0, s, mode="none"), "device_memory_bytes must be > 0, got 0"),
        (lambda s: loss_head_bytes_per_token(s, dtype_bytes=0), "dtype_bytes must be an integer >= 1, got 0"),
        (lambda s: step_peak(s, seq_len=0, mode="none"), "seq_len must be an integer >= 1, got 0"),
        (lambda s: step_phases(s, mode="none", keep_last_layers=-1), "keep_last_layers and prefetch_layers"),
        (lambda s: fixed_bytes(s, optimizer_states=-1), "optimizer_states must be >= 0, got -1"),
        (lambda s: step_time(s, seq_len=8, efficiency=1.5), "efficiency must be in (0, 1], got 1.5"),
    ],
)
def test_bad_values_are_named(call, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        call(PRESETS["llama-3-8b"])


# --- allocations counted on the CPU ----------------------------------------------------------


@contextlib.contextmanager
def one_thread():
    # Tiny ops on a loaded 2-core machine run many times faster without intra-op threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def peak_allocated(fn) -> tuple[int, list[str]]:
    """The most bytes the CPU allocator held at once while `fn` ran, beyond what was allocated
    before, and the ops running at that moment, innermost first. Every allocation and free is
    reported by torch's profiler with its size, so this is exact."""
    with one_thread(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    live = peak = 0
    at = None
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        if live > peak:
            peak, at = live, start
    running = [e for e in events if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns()]
    return peak, [e.name() for e in sorted(running, key=lambda e: e.end_ns() - e.start_ns())]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_head_bytes_match_cpu_allocations(dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, vocab, tokens = 32, 4096, 256
    hidden_states = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype).requires_grad_(False)
    labels = torch.randint(vocab, (1, tokens))

    def step():
        # As a training loop does: only the loss outlives the forward.
        ForCausalLMLoss(lm_head(hidden_states), labels, vocab_size=vocab).backward()

    measured, running = peak_allocated(step)
    shape = Shape("llama", hidden, 4 * hidden, 1, 4, 4, 8, vocab)
    predicted = loss_head_bytes_per_token(shape, dtype_bytes=dtype.itemsize) * tokens
    assert measured == pytest.approx(predicted, rel=0.01)
    assert "LogSoftmaxBackward0" in running  # the backward of log_softmax, where the model says


def test_loss_head_measurement_sees_logits_a_loop_keeps_alive():
    """Companion: the measurement is not blind to the logits. A loop that keeps the model output
    (and so the bf16 logits) through backward holds 2 x vocab bytes per token more."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, vocab, tokens = 32, 4096, 256
    hidden_states = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    labels = torch.randint(vocab, (1, tokens))
    kept = []

    def step():
        kept.append(lm_head(hidden_states))
        ForCausalLMLoss(kept[-1], labels, vocab_size=vocab).backward()

    measured, _ = peak_allocated(step)
    shape = Shape("llama", hidden, 4 * hidden, 1, 4, 4, 8, vocab)
    predicted = loss_head_bytes_per_token(shape, dtype_bytes=2) * tokens
    assert measured == pytest.approx(predicted + 2 * vocab * tokens, rel=0.01)


def phase_running(running: list[str]) -> str:
    """The model's name for the phase in which these ops run."""
    if "LogSoftmaxBackward0" in running:
        return "loss head"
    if "PowBackward0" in running:
        return "final norm backward"
    return "layer backward" if any(name.startswith("autograd::engine") for name in running) else "forward"


def tiny_step_model(tuning, checkpointing, vocab):
    model = tiny_model(
        "llama",
        hidden_size=128,
        intermediate_size=448,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=vocab,
        max_position_embeddings=256,
    ).to(torch.bfloat16)
    shape = Shape.from_config(model.config)
    if tuning != "full":
        # PEFT's default casts the adapters to fp32 on a bf16 model; "lora16" keeps them in bf16.
        config = LoraConfig(r=8, target_modules="all-linear")
        model = get_peft_model(model, config, autocast_adapter_dtype=tuning == "lora32")
    if checkpointing:
        model.get_base_model().activation_checkpointing_enable() if tuning != "full" else (
            model.activation_checkpointing_enable()
        )
    return model, shape


def measured_slope(model, vocab, lengths=(128, 256)):
    """Bytes one more token adds to the step's peak (the fixed part drops out), and the ops running
    at the peak of the longer step."""
    peaks = []
    for tokens in lengths:
        ids = torch.randint(vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))

        def step(ids=ids):
            model(input_ids=ids, labels=ids).loss.backward()

        with one_thread():
            step()  # warm-up: lazily built buffers are not the step's
        model.zero_grad(set_to_none=True)
        peaks.append(peak_allocated(step))
        model.zero_grad(set_to_none=True)
    (short, _), (long, running) = peaks
    return (long - short) / (lengths[1] - lengths[0]), running


@pytest.mark.parametrize("vocab", [32, 4096], ids=["layers", "loss-head"])
@pytest.mark.parametrize("tuning", ["full", "lora16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["none", "checkpointing"])
def test_step_peak_per_token_matches_cpu_allocations(tuning, checkpointing, vocab):
    torch.manual_seed(0)
    model, shape = tiny_step_model(tuning, checkpointing, vocab)
    slope, running = measured_slope(model, vocab)
    lora = {} if tuning == "full" else {"lora_rank": 8, "lora_dtype_bytes": 2}
    # The phase that wins once tokens dominate: at a few hundred tokens the layer phase's fixed
    # part (it counts every gradient, an upper bound) can still decide it on a model this small.
    peak = step_peak(shape, seq_len=512, mode="checkpointing" if checkpointing else "none", **lora)
    assert peak.per_token_bytes == pytest.approx(slope, rel=0.10)
    # The phase running at the measured peak is one the model puts within 5% of its peak: where
    # two phases are that close (the final norm's backward and the last layer's, without a loss
    # head), which one wins depends on the CPU's kernels (seen on two machines).
    running_phase = phase_running(running)
    close = [phase.name for phase in peak.phases if phase.bytes_at(512) >= 0.95 * peak.peak_bytes]
    assert any(name.endswith(running_phase) for name in close), f"running at the peak: {running[:4]}; {close}"


def test_fp32_adapter_layer_phase_matches_cpu_allocations_plus_the_cpu_only_cast():
    """With fp32 adapters on a bf16 model, PEFT adds the bf16 base output to the fp32 adapter
    output. On the CPU that add first copies the bf16 operand to fp32 (4 bytes per element), which
    CUDA does in registers; under checkpointing the recompute of gate/up holds that copy at the
    peak: 4 x intermediate bytes per token the device does not spend."""
    a, b = torch.ones(256, 256, dtype=torch.bfloat16), torch.ones(256, 256)
    extra, _ = peak_allocated(lambda: a + b)
    assert extra == 2 * b.nbytes  # the result and the CPU's fp32 copy of `a`

    model, shape = tiny_step_model("lora32", True, 32)
    slope, _ = measured_slope(model, 32)
    peak = step_peak(shape, seq_len=512, mode="checkpointing", lora_rank=8, lora_dtype_bytes=4)
    assert peak.phase.name == "last layer backward"
    assert peak.per_token_bytes + 4 * shape.intermediate == pytest.approx(slope, rel=0.10)


# --- the command line --------------------------------------------------------------------------


def run_cli(capsys, *argv):
    assert main(["estimate", *argv]) == 0
    return capsys.readouterr().out


def test_cli_device_memory_prints_the_longest_sequence_per_mode(capsys):
    out = run_cli(capsys, "--preset", "llama-3-8b", "--lora-rank", "16", "--device-memory", "80")
    assert "longest sequence that fits in 80.00 GiB (batch 1), predicted:" in out
    shape = PRESETS["llama-3-8b"]
    for mode in MODES:
        expected = [
            max_seq_len(80 * 2**30, shape, mode=mode, fused_loss=fused, lora_rank=16, lora_dtype_bytes=4)
            for fused in (False, True)
        ]
        row = next(line for line in out.splitlines() if line.split()[:1] == [mode] and len(line.split()) == 3)
        assert [int(x) for x in row.split()[1:]] == expected
    # The fused loss is what makes checkpointing + hf_offload go furthest.
    assert "checkpointing+hf_offload" in out


def test_cli_says_which_rates_it_assumed_and_where_they_came_from(capsys):
    out = run_cli(capsys, "--seq-len", "4096")
    assert "assumed device: h200 (the default" in out and "789 TFLOP/s sustained bf16 matmul" in out
    assert "measured on our H200" in out and "step efficiency: 0.54" in out
    out = run_cli(capsys, "--seq-len", "4096", "--device", "a100-40gb")
    assert "assumed device: a100-40gb: 250 TFLOP/s" in out and "datasheet" in out
    # --device alone also gives the table, for that device's memory.
    assert "longest sequence that fits in 38.60 GiB" in out
    out = run_cli(capsys, "--seq-len", "4096", "--tflops", "500", "--efficiency", "0.5")
    assert "matmul rate: 500 TFLOP/s, given with --tflops" in out and "step efficiency: 0.5, given with" in out
    assert "at 250 TFLOP/s = 500 x 0.5" in out


def test_cli_lists_the_device_presets(capsys):
    out = run_cli(capsys, "--list-devices")
    for name in ("h200", "h100-80gb", "a100-80gb", "a100-40gb", "l40s", "rtx4090"):
        assert f"| {name} | {DEVICES[name].tflops:g} |" in out
    assert "measured on our H200" in out and "derated" in out


def test_cli_whole_step_table_follows_fused_loss(capsys):
    out = run_cli(capsys, "--lora-rank", "16", "--checkpointing", "--seq-len", "32768")
    assert "standard loss" in out and re.search(r"checkpointing\+hf_offload\s+\S+\s+1\.56\d\s+loss head", out)
    out = run_cli(capsys, "--lora-rank", "16", "--checkpointing", "--seq-len", "32768", "--fused-loss")
    assert "fused loss" in out and re.search(r"checkpointing\+hf_offload\s+\S+\s+0\.\d+\s+last layer backward", out)


def test_cli_says_when_nothing_fits(capsys):
    out = run_cli(capsys, "--preset", "llama-3-8b", "--device-memory", "8")
    assert "nothing fits: weights, gradients and optimizer state alone need" in out


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--device-memory", "0"], "device-memory must be > 0, got 0.0"),
        (["--device-memory", "lots"], "device-memory must be a number, got 'lots'"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--efficiency", "1.5"], "must be a fraction in (0, 1], got 1.5"),
        (["--optimizer-states", "-1"], "optimizer-states must be >= 0, got -1"),
        (["--tflops", "0"], "tflops must be > 0, got 0.0"),
    ],
)
def test_cli_bad_arguments_are_named(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", *argv])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


def test_cli_says_how_many_layers_a_budget_keeps(capsys):
    """`--max-device-gib` runs the engine's own planner on the estimate's bytes per layer."""
    from hf_offload.engine.planner import resident_peak

    result = estimate(PRESETS["llama-3.2-1b"], seq_len=4096)
    layer = result.layer_bytes
    expected = {0.1: 15, 2.0: 12, 100.0: 0}  # offloaded layers, of 15 offloadable
    for gib, offloaded in expected.items():
        out = run_cli(capsys, "--preset", "llama-3.2-1b", "--seq-len", "4096", "--max-device-gib", str(gib))
        line = next(line for line in out.splitlines() if line.startswith("device-memory budget"))
        assert f"offloads the first {offloaded} of 15 offloadable layers and keeps {15 - offloaded}" in line
        budget = int(gib * 2**30)
        peak = resident_peak([layer] * 16, offloaded, 1)
        assert f"at most {peak / 2**30:.2f} GiB" in line
        # The fewest layers that fit: one fewer would not (unless none is needed or none fits).
        if offloaded > 0 and peak <= budget:
            assert resident_peak([layer] * 16, offloaded - 1, 1) > budget
    assert "more than the budget" in run_cli(capsys, "--preset", "llama-3.2-1b", "--max-device-gib", "0.1")
