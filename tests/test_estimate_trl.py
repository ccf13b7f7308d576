"""`hf-offload estimate --trainer {sft,dpo,grpo}`: TRL's step from the command, its answer and its errors."""

from __future__ import annotations

import json

import pytest
from test_estimate import estimate_json, restore_logging, simulate_once  # noqa: F401 (restore_logging: autouse)

from hf_offload.tools.cli import main


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--trainer", "ppo"], "argument --trainer: invalid choice: 'ppo'"),
        (["--prompt-length", "64"], "argument --prompt-length: 64 is for --trainer dpo or grpo, not no --trainer"),
        (["--trainer", "sft", "--completion-length", "4096"],
         "argument --completion-length: 4096 is for --trainer dpo or grpo, not --trainer sft"),
        (["--trainer", "dpo", "--num-generations", "4"],
         "argument --num-generations: 4 is for --trainer grpo, not --trainer dpo"),
        (["--trainer", "sft", "--beta", "0.1"], "argument --beta: 0.1 is for --trainer grpo, not --trainer sft"),
        (["--trainer", "grpo", "--beta", "-1"], "beta must be a finite number >= 0, got '-1'"),
        (["--trainer", "dpo", "--no-old-log-probs"],
         "argument --old-log-probs: is for --trainer grpo, not --trainer dpo"),
        (["--trainer", "grpo", "--num-generations", "1"],
         "argument --num-generations: GRPO requires at least 2 generations per prompt to calculate the advantages. "
         "You provided 1, which is less than the minimum required."),
        (["--trainer", "grpo", "--num-generations", "4", "--generation-batch-size", "6"],
         "argument --generation-batch-size: generation_batch_size (6) must be divisible by num_generations (4)."),
        (["--trainer", "grpo", "--batch-size", "3", "--generation-batch-size", "8"],
         "argument --generation-batch-size: generation_batch_size (8) must be divisible by the global batch size (3)."),
        (["--trainer", "grpo", "--generation-batch-size", "8", "--steps-per-generation", "8"],
         "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"),
        (["--trainer", "grpo", "--vllm-enable-sleep-mode"],
         "argument --vllm-enable-sleep-mode: configures vLLM: give --use-vllm"),
        (["--trainer", "grpo", "--use-vllm", "--vllm-mode", "server", "--vllm-gpu-memory-utilization", "0.5"],
         "argument --vllm-gpu-memory-utilization: is for --vllm-mode colocate"),
        (["--trainer", "grpo", "--use-vllm", "--vllm-gpu-memory-utilization", "1.5"],
         "argument --vllm-gpu-memory-utilization: a fraction of the GPU's memory in (0, 1], got 1.5"),
        (["--trainer", "dpo", "--use-vllm"], "argument --use-vllm: is for --trainer grpo, not --trainer dpo"),
        (["--trainer", "grpo", "--ref-model"], "argument --ref-model: is for --trainer dpo, not --trainer grpo"),
        (["--trainer", "dpo", "--lora-rank", "4", "--sync-ref-model"],
         "argument --sync-ref-model: with LoRA DPOTrainer keeps no reference model to sync"),
        (["--trainer", "dpo", "--sync-ref-model", "--precompute-ref-log-probs"],
         "argument --sync-ref-model: not with --precompute-ref-log-probs"),
        (["--trainer", "grpo", "--sync-ref-model"],
         "argument --sync-ref-model: with beta 0 (TRL's default) GRPOTrainer keeps no reference model"),
        (["--trainer", "sft", "--liger"], "argument --trainer: sft: TRL's trainers refuse Liger's fused cross-entropy"),
        (["--trainer", "dpo", "--modes", "checkpointing+liger"], "refuse Liger's fused cross-entropy"),
        (["--trainer", "dpo", "--sp", "2"], "argument --trainer: dpo with --sp is not simulated (drop --sp)"),
        (["--trainer", "grpo", "--padded"], "argument --trainer: grpo with --padded is not simulated"),
        (["--trainer", "sft", "--offload-params"], "argument --trainer: sft with --offload-params is not simulated"),
    ],
)  # fmt: skip
def test_bad_trl_arguments_are_named_before_anything_loads(capsys, monkeypatch, args, fragment):
    def loaded(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("hf_offload.tools.presets.preset_config", loaded)
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "tiny", *args])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


GRPO = ["--preset", "tiny", "--lora-rank", "4", "--trainer", "grpo", "--prompt-length", "128", "--completion-length",
        "512", "--num-generations", "2", "--modes", "checkpointing", "--device-memory", "0.125", "--granularity",
        "256", "--optimizer-states", "0"]  # fmt: skip


def test_grpo_answers_with_generation_in_it_with_trls_defaults(capsys, monkeypatch):
    """The answer comes first and counts completion tokens, after the prompt; it is the longest
    completion that generation (TRL's default: transformers' generate on the training model) and
    the step both fit, each with its peak, and the GRPO cycle's time; the JSON carries GRPOConfig's
    fields with TRL's defaults (beta 0, no old log-probs without vLLM)."""
    simulate_once(monkeypatch)
    assert main(["estimate", *GRPO]) == 0
    out = capsys.readouterr().out
    answer = out.index("Longest completion in 128.0 MiB")
    headline = out[answer : out.index("\nmode ")]
    assert "transformers' generate on the training model (use_vllm=False, TRL's default)" in headline
    assert "2 rows decoded together" in headline
    assert "generation's peak" in headline and "the step alone reaches" in headline
    assert "one generation batch at" in headline and "decode steps" in headline and "scoring" in headline
    assert "beta 0, no old log-probs" in out
    assert main(["estimate", *GRPO, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    trl = result["setup"]["trl"]
    assert trl["trainer"] == "grpo" and trl["num_generations"] == 2 and trl["prompt_length"] == 128
    assert trl["beta"] == 0 and trl["old_log_probs"] is False and trl["use_vllm"] is False
    assert trl["generation_batch_size"] == 2 and trl["reference_model"] is False
    mode = result["modes"]["checkpointing"]
    generation = mode["generation"]
    if generation["step_checked_at_generation_limit"]:  # the step fits where generation stops
        assert mode["max_seq_len"] == generation["max_seq_len_generation"]
    else:
        assert mode["max_seq_len"] == generation["max_seq_len_step"] < generation["max_seq_len_generation"]
    assert generation["peak_bytes"] <= 0.125 * 2**30 and mode["max_seq"]["peak_bytes"] <= 0.125 * 2**30
    low, high = generation["cycle"]["seconds_range"]
    assert 0 < low <= high


def test_vllm_colocated_holds_its_share_during_the_step_unless_asleep(capsys, monkeypatch):
    """vLLM colocated takes vllm_gpu_memory_utilization of the GPU for the whole run: the step gets
    the rest. Asleep during the step (sleep mode), vLLM keeps only its graphs and what is outside
    PyTorch, and the step gets all but that; the text names the assumptions about vLLM."""
    common = ["--preset", "tiny", "--lora-rank", "4", "--trainer", "grpo", "--num-generations", "2", "--modes",
              "checkpointing", "--granularity", "256", "--optimizer-states", "0", "--use-vllm",
              "--vllm-gpu-memory-utilization", "0.18", "--device-memory", "2"]  # fmt: skip
    whole = estimate_json(capsys, *common)
    awake, reserve = whole["modes"]["checkpointing"], whole["reserve"]["bytes"]  # what a real run leaves free
    simulate_once(monkeypatch)
    asleep = estimate_json(capsys, *common, "--vllm-enable-sleep-mode")["modes"]["checkpointing"]
    share = awake["generation"]["vllm"]["share_bytes"]
    memory = 2 * 2**30
    assert awake["generation"]["during_step_bytes"] == share
    assert asleep["generation"]["during_step_bytes"] == asleep["generation"]["vllm"]["asleep_bytes"] < share
    assert awake["max_seq"]["memory_bytes"] == memory - share - reserve  # what the step may use
    assert asleep["max_seq"]["memory_bytes"] == memory - asleep["generation"]["vllm"]["asleep_bytes"] - reserve
    assert awake["generation"]["max_seq_len_generation"] == asleep["generation"]["max_seq_len_generation"]
    assert main(["estimate", *common, "--vllm-enable-sleep-mode"]) == 0
    out = capsys.readouterr().out
    assert "vLLM colocated (vllm_mode=\"colocate\", vllm_gpu_memory_utilization=0.18, sleep mode on)" in out
    assert "vLLM assumed (not run here)" in out


def test_dpo_full_fine_tuning_counts_the_reference_model_and_says_so(capsys):
    """DPOTrainer keeps a second copy of the model for full fine-tuning (not with LoRA, nor with
    the reference log-probs precomputed): its weights are in the peak, named, in the text and the
    JSON."""
    base = ["--preset", "tiny", "--trainer", "dpo", "--seq-len", "256", "--modes", "none", "--optimizer-states", "0"]
    full = estimate_json(capsys, *base)
    parts = {part["phase"]: part["bytes"] for part in full["modes"]["none"]["peak"]["parts"]}
    assert full["setup"]["trl"]["reference_model"] is True
    assert parts["reference"] == parts["weights"]
    for extra in (["--lora-rank", "4"], ["--precompute-ref-log-probs"]):
        result = estimate_json(capsys, *base, *extra)
        assert result["setup"]["trl"]["reference_model"] is False
        assert "reference" not in {part["phase"] for part in result["modes"]["none"]["peak"]["parts"]}
    assert main(["estimate", *base]) == 0
    out = capsys.readouterr().out
    assert "a reference model beside the policy" in out and "the reference model's weights" in out


def test_none_fits_says_why(capsys):
    """Where no length fits, the answer says what the shortest step held and how much of it no
    length changes: the weights, the optimizer state and the gradients, against the usable memory."""
    args = ["estimate", "--preset", "tiny", "--modes", "none", "--device-memory", "0.1", "--granularity", "256",
            "--reserve", "allocator=0"]  # the whole memory usable: the figures below are the device's  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    headline = out[out.index("Longest sequence in") : out.index("\nmode ")]
    reason = headline[headline.index("none fits") :]
    assert "at 256 tokens the step peaks at" in reason and "of 102.4 MiB usable" in reason
    assert "weights, gradients and optimizer state alone, at any length" in reason
    assert "of 102.4 MiB: more than the device has: no length fits" in reason
    result = estimate_json(capsys, *args[1:])
    none_fits = result["modes"]["none"]["max_seq"]["none_fits"]
    assert none_fits["seq_len"] == 256 and none_fits["fixed_bytes"] > none_fits["usable_bytes"] == int(0.1 * 2**30)


def test_each_trainer_runs_its_own_step(capsys):
    """SFT scores one row, DPO a chosen and a rejected row after the prompt (and a reference pass),
    GRPO the completion of one micro-batch: at the same length their peaks differ, DPO's highest."""
    base = ["--preset", "tiny", "--seq-len", "512", "--modes", "none", "--optimizer-states", "0", "--json"]
    peaks = {}
    for trainer in (None, "sft", "dpo", "grpo"):
        extra = [] if trainer is None else ["--trainer", trainer]
        assert main(["estimate", *base, *extra]) == 0
        result = json.loads(capsys.readouterr().out)
        peaks[trainer] = result["modes"]["none"]["peak_bytes"]
        assert (result["setup"]["trl"] or {}).get("trainer") == trainer
    assert peaks["dpo"] > max(peaks["sft"], peaks["grpo"])
    assert len(set(peaks.values())) == 4
