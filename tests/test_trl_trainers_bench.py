"""`python -m hf_offload.tools.benchmarks.trl_trainers`, the GPU script for SFTTrainer and GRPOTrainer,
run end to end on the CPU (--device cpu: tiny preset, a few tokens, hf_offload's CPU simulation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_trl import cpu_capable_trl_offloading

from hf_offload.tools.benchmarks import trl_trainers

SMOKE = ["--device", "cpu", "--steps", "1"]


def table_rows(output: str) -> dict[tuple[str, str, int], dict[str, str]]:
    """The printed markdown table, one dict per row keyed by (trainer, setup, seq)."""
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        row = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        rows[row["trainer"], row["setup"], int(row["seq"])] = row
    return rows


def test_cpu_smoke_run_measures_both_trainers_and_records_trl_failing(capsys):
    """Both trainers, all three setups, two lengths: the runs without offloading and with
    hf_offload train and report tokens per step as the trainers counted them (SFT: seq; GRPO: 2
    completions of prompt + completion = seq), hf_offload moved something, GRPO's generation
    time is shown; TRL's offloading, which raises without an accelerator, is recorded as failed
    with the reason and its longer length skipped, and the script still exits 0."""
    assert trl_trainers.main([*SMOKE, "--seq-lens", "16", "24"]) == 0
    output = capsys.readouterr().out
    assert "device: CPU" in output and "trl 1.16" in output and "date: " in output
    assert "GRPOConfig in TRL" in output  # says how the GRPO trl_offload row is made
    rows = table_rows(output)
    assert len(rows) == 2 * 3 * 2
    for trainer, per_sequence in (("sft", 1), ("grpo", 2)):
        for seq in (16, 24):
            for setup in ("neither", "hf_offload"):
                row = rows[trainer, setup, seq]
                assert row["status"] == "ok", row
                assert float(row["tokens/step"]) == per_sequence * seq
                assert float(row["tokens/s"]) > 0 and row["tokens/s vs neither"].endswith("x")
                assert row["peak GiB"] == "-"  # no device memory on the CPU: not invented
                assert (row["of it generate ms"] != "-") == (trainer == "grpo")
            assert rows[trainer, "neither", seq]["tokens/s vs neither"] == "1.000x"
            assert float(rows[trainer, "hf_offload", seq]["offloaded MiB"]) > 0
            assert rows[trainer, "neither", seq]["offloaded MiB"] == "-"
        # Raised by TRL without an accelerator: an AttributeError on torch's CPU build, an AcceleratorError
        # ("CUDA driver version is insufficient") on a CUDA build of torch on a machine without a GPU.
        status = rows[trainer, "trl_offload", 16]["status"]
        assert status.startswith(("failed: AttributeError", "failed: AcceleratorError")), status
        assert rows[trainer, "trl_offload", 24]["status"] == "skipped: failed at a shorter length"


def test_trl_offloading_rows_run_where_trl_can(capsys, monkeypatch):
    """With TRL's offloading able to run (CPU taken as its accelerator, no pinning, no streams:
    tests/test_trl.py's patch), the trl_offload rows train, for GRPO too, where the script enters
    TRL's context around training_step itself; TRL's hooks saw tensors in both trainers."""
    created = cpu_capable_trl_offloading(monkeypatch)
    import trl.models.activation_offloading as activation_offloading
    import trl.trainer.sft_trainer as sft_trainer

    monkeypatch.setattr(
        activation_offloading, "get_act_offloading_ctx_manager", sft_trainer.get_act_offloading_ctx_manager
    )
    assert trl_trainers.main([*SMOKE, "--seq-lens", "16", "--setups", "trl_offload"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [row["status"] for row in rows.values()] == ["ok", "ok"]
    assert float(rows["grpo", "trl_offload", 16]["tokens/step"]) == 32
    assert len(created) == 2 and all(context.tensor_id > 0 for context in created), "TRL's offloading did not run"


def test_tiling_stage_runs_both_trainers_tiled_beside_the_simulator(capsys, monkeypatch):
    """--stage tiling, at a tiny size on the CPU: both trainers train with offloading and tiling
    under TRL's fused head (tiling's wrappers ran in training), and each row shows the simulator's peak for the
    same step, from a simulation of that trainer, batch and length."""
    import hf_offload.tiling.per_token as per_token

    asked, sliced = [], []
    simulate = trl_trainers.simulated_peak

    def recorded(trainer, setup, seq_len, options):
        asked.append((trainer, setup, seq_len, options.generations, options.completion_length))
        return simulate(trainer, setup, seq_len, options)

    forward = per_token.tiled_forward

    def counting(self, *args, **kwargs):
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[1] > 8 and torch.is_grad_enabled():
            sliced.append(type(self).__name__)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(trl_trainers, "simulated_peak", recorded)
    monkeypatch.setattr(per_token, "tiled_forward", counting)
    argv = [*SMOKE, "--stage", "tiling", "--seq-lens", "24", "--completion-length", "8"]
    assert trl_trainers.main(argv) == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) == {("sft", "hf_offload_tiled", 24), ("grpo", "hf_offload_tiled", 24)}
    for row in rows.values():
        assert row["status"] == "ok" and row["peak GiB"] == "-" and float(row["simulated GiB"]) > 0
    assert asked == [("sft", "hf_offload_tiled", 24, 2, 8), ("grpo", "hf_offload_tiled", 24, 2, 8)]
    assert sliced


def test_tiling_stage_defaults_on_a_gpu():
    args = trl_trainers.parse_args(["--stage", "tiling"])
    assert args.lengths == {"sft": [65536, 131072], "grpo": [512 + 4096]}
    assert args.setups == ["hf_offload_tiled"] and args.steps == 2 and args.simulate
    plain = trl_trainers.parse_args([])
    assert "hf_offload_tiled" not in plain.setups and not plain.simulate


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert trl_trainers.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-lens", "32", "--completion-length", "32"], "--seq-lens [32] leave no prompt"),
        (["--generations", "1"], "--generations must be at least 2"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        trl_trainers.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny", "1b", "llama-3-8b", "qwen2-7b"])
def test_every_preset_builds_in_its_own_architecture(preset):
    """On the meta device (no memory): the model the script trains has the preset's class and the
    script's token ids and positions (a Llama config forced on the Qwen2 preset was not Qwen2,
    and the 8B presets' own max_position_embeddings clashed with the script's)."""
    options = trl_trainers.Options(
        **{
            **{field.name: None for field in dataclasses.fields(trl_trainers.Options)},
            "preset": preset,
            "device": torch.device("meta"),
            "dtype": torch.bfloat16,
            "max_positions": 4096,
        }
    )
    model = trl_trainers.build_model(options)
    name = trl_trainers.PRESET_ALIASES.get(preset, preset)
    assert model.config.model_type == trl_trainers.PRESET_CONFIGS[name]["model_type"]
    assert model.config.max_position_embeddings == 4096
    assert (model.config.pad_token_id, model.config.eos_token_id) == (trl_trainers.PAD, trl_trainers.EOS)


def test_generation_stage_measures_each_phase_beside_the_simulator(capsys):
    """--stage generation, at a tiny size on the CPU: GRPO generates with transformers' generate at
    two completion lengths and each row has the simulator's generation and step peaks and the
    predicted generation time beside what was measured (times here; memory on a GPU); vLLM, which
    does not import here, is recorded as skipped with the reason."""
    assert trl_trainers.main(["--device", "cpu", "--stage", "generation"]) == 0
    output = capsys.readouterr().out
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[1:]]
    ran = [row for row in rows if row["generator"] == "transformers"]
    assert [int(row["completion"]) for row in ran] == [6, 8]
    for row in ran:
        assert row["status"] == "ok" and float(row["generate s"]) > 0 and float(row["step s"]) > 0
        assert float(row["simulated"]) > 0 and "-" in row["predicted s"]
        assert row["generate peak GiB"] == "-"  # no device memory on the CPU: not invented
    assert all(row["status"].startswith("skipped: vLLM does not import here") for row in rows if row not in ran)
