"""`hf-offload estimate --trainer {sft,dpo,grpo}`: TRL's step from the command, its answer and its errors."""

from __future__ import annotations

import json

import pytest
from test_estimate import restore_logging, simulate_once  # noqa: F401 (restore_logging: an autouse fixture)

from hf_offload.tools import estimate as estimate_module
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
         "argument --no-old-log-probs: is for --trainer grpo, not --trainer dpo"),
        (["--trainer", "grpo", "--num-generations", "0"], "num-generations"),
        (["--trainer", "sft", "--liger"], "argument --trainer: sft: TRL's trainers refuse Liger's fused cross-entropy"),
        (["--trainer", "dpo", "--modes", "checkpointing+liger"], "refuse Liger's fused cross-entropy"),
        (["--trainer", "dpo", "--sp", "2"], "argument --trainer: dpo with --sp is not simulated (drop --sp)"),
        (["--trainer", "grpo", "--padded"], "argument --trainer: grpo with --padded is not simulated"),
        (["--trainer", "sft", "--offload-params"], "argument --trainer: sft with --offload-params is not simulated"),
        (["--trainer", "grpo", "--num-generations", "4", "--batch-size", "8"],
         "argument --batch-size: 8 rows per policy step is more than the 4 generations of the batch"),
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


def test_grpo_answers_the_longest_completion_first_and_says_generation_is_not_simulated(capsys, monkeypatch):
    """The answer comes first and counts completion tokens, after the prompt; the text and the
    JSON say generation is outside the step, and the JSON carries GRPOConfig's fields."""
    args = ["--preset", "tiny", "--lora-rank", "4", "--trainer", "grpo", "--prompt-length", "128",
            "--completion-length", "512", "--num-generations", "2", "--beta", "0.04", "--modes", "checkpointing",
            "--device-memory", "0.125", "--granularity", "256", "--optimizer-states", "0"]  # fmt: skip
    simulate_once(monkeypatch)
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    answer = out.index("Longest completion in 128.0 MiB")
    assert answer < out.index("peak at")
    assert "TRL's GRPOTrainer step (2 generations after a 128-token prompt, beta 0.04, old log-probs" in out
    assert estimate_module.GENERATION_NOT_SIMULATED in out[answer : out.index("peak at")]
    assert "batch 1 x 512-token completions" in out
    assert main(["estimate", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    trl = result["setup"]["trl"]
    assert trl["trainer"] == "grpo" and trl["num_generations"] == 2 and trl["prompt_length"] == 128
    assert trl["beta"] == 0.04 and trl["length_is"] == "completion" and "not simulated" in trl["generation"]
    assert trl["old_log_probs"] is True
    assert result["modes"]["checkpointing"]["seq_len"] == 512
    assert result["longest"]["max_seq_len"] >= 512


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
