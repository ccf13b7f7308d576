"""The prepared GPU commands, run end to end on the CPU (`--cpu-smoke`: tiny preset, simulated
copies, CUDA-only measurements reported as skipped), so that the first GPU run does not find a
bug in the scripts themselves. What they measure on a GPU is in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from hf_offload.tools.benchmarks import gpu_check, gpu_long_context


def test_gpu_check_runs_every_stage(capsys):
    assert gpu_check.main(["--cpu-smoke", "--skip-tests", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    for stage in ("1. full fine-tuning sweep", "2. CPU issue time", "3. synchronising calls", "4. LoRA r=16"):
        assert stage in out
    assert "| 128 | checkpointing+hf_offload_auto | ok |" in out  # the budget table, for each length
    assert "skipped: CUDA events need a CUDA device" in out
    assert "skipped: torch.cuda.set_sync_debug_mode needs a CUDA device" in out
    assert "| trl_offload | 64 |" in out and "trl_offload needs an accelerator" in out  # skipped on the CPU, saying why


def test_gpu_long_context_runs_every_stage(capsys):
    # 512 and 1024 tokens: the tiny model's layers are tiled in slices of 256 (its hidden size).
    args = ["--cpu-smoke", "--skip-tests", "--lengths", "512", "1024", "--tiling-lengths", "512", "1024"]
    args += ["--stages", "peaks", "tiling"]  # the disk stage has its own test below
    assert gpu_long_context.main(args) == 0
    out = capsys.readouterr().out
    predicted = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 4 and cells[1].endswith(" MB"):  # the predictions table: mode, slope, fixed, max seq
            predicted[cells[0]] = int(cells[3])
    # Under the same limit, offloading the checkpoint inputs leaves room for longer sequences.
    assert predicted["checkpointing+hf_offload"] > predicted["checkpointing"] > 0
    assert "max seq: ckpt+hf_offload+FLCE vs ckpt alone (>= 5x) | not measured" in out  # Liger needs Triton
    assert "stopped at 512: failed: RuntimeError" in out
    # Tiling's stage: its own loss head runs on the CPU (simulated beside it); the time targets
    # compare with the Liger stack, which needs Triton, so they are said to be not measured.
    assert "== 3. sequence tiling at 512 and 1024 tokens" in out
    assert "| checkpointing+hf_offload+tiled | 512 | - |" in out
    assert "| 512 | - | - | not measured | <= 1.10x | - |" in out


def test_gpu_long_context_disk_stage_runs_on_the_cpu(capsys):
    """The disk tier's stage end to end on the CPU path: throughput against dd, the GPU-only checks
    said to be skipped, and a step with most layer inputs on disk, bit-identical to host memory."""
    assert gpu_long_context.main(["--cpu-smoke", "--stages", "disk"]) == 0
    out = capsys.readouterr().out
    assert "== 5. the disk tier" in out
    assert "bytes intact: True" in out
    assert "pinned memory: skipped: needs a CUDA device" in out
    assert "GPUDirect Storage: skipped: needs a CUDA device" in out
    row = next(line for line in out.splitlines() if line.startswith("| 256 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert int(cells[5]) > 0, "no layer went to disk"
    assert cells[-1] == "True", "gradients through the disk tier differ from host memory"


def test_budget_target_compares_with_the_fastest_mode_that_fits():
    from hf_offload.tools.bench import Record

    records = [
        Record("none", 4096, "ok", step_seconds=1.0),
        Record("checkpointing", 4096, "ok", step_seconds=1.2),
        Record("hf_offload", 4096, "ok", step_seconds=3.0),
        Record("hf_offload_auto", 4096, "ok", step_seconds=1.04, layers_kept_for_budget=15),
        Record("checkpointing+hf_offload_auto", 4096, "ok", step_seconds=1.3, layers_kept_for_budget=15),
        Record("none", 16384, "oom"),
        Record("hf_offload", 16384, "ok", step_seconds=4.0),
        Record("hf_offload_auto", 16384, "oom"),
    ]
    table = gpu_check.budget_table(records, [4096, 16384])
    assert "| 4096 | hf_offload_auto | ok | 15 | 1.040x | none | met |" in table
    # Checkpointing modes are held to the fastest checkpointing mode: recomputing costs what it costs.
    assert "| 4096 | checkpointing+hf_offload_auto | ok | 15 | 1.083x | checkpointing | MISSED |" in table
    assert "| 16384 | hf_offload_auto | oom | - | - | - | MISSED |" in table  # full offloading fitted


def test_simulated_peaks_script_runs_end_to_end(tmp_path):
    """The script behind the README's plot, on a tiny model with small budgets: the table, the
    JSON and the plot, each budget's longest sequence found."""
    import json

    from hf_offload.tools.benchmarks import simulated_peaks

    modes = ["checkpointing", "checkpointing+hf_offload", "checkpointing+hf_offload+tiled"]
    # The tiled lines start where the slices' fixed costs are small, so that they predict the answer
    # and the search simulates only the two grid points around it (each tiled step runs op by slice).
    argv = ["--presets", "tiny", "--modes", *modes, "--tunings", "lora", "--lengths", "256", "512",
            "--granularity", "256", "--tiled-lengths", "8192", "16384", "--tiled-granularity", "2048",
            "--tile-tokens", "512", "--budgets", "0.15", "0.2", "--jobs", "2", "--out", str(tmp_path)]  # fmt: skip
    assert simulated_peaks.main(argv) == 0
    (panel,) = json.loads((tmp_path / "simulated_peaks.json").read_text())
    longest = {}
    for mode in modes:
        small, large = (panel["modes"][mode]["longest"][f"{gib} GiB"]["max_seq_len"] for gib in ("0.15", "0.2"))
        assert 0 < small < large
        longest[mode] = large
    # Tiling the tiny model's loss head (its 2048-word logits) and layers, 512 tokens a slice, goes further.
    assert longest["checkpointing+hf_offload+tiled"] > longest["checkpointing+hf_offload"]
    assert panel["modes"]["checkpointing+hf_offload+tiled"]["granularity"] == 2048
    assert (tmp_path / "simulated_peaks.png").stat().st_size > 10_000


def test_gpu_long_context_ladder_stage_runs_on_the_cpu(capsys):
    """The longest-context recipe piece by piece: every rung runs a step and is simulated beside
    it; with every piece on, the simulated peak is no higher than with none."""
    assert gpu_long_context.main(["--cpu-smoke", "--stages", "ladder", "--ladder-length", "512"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for name, _pieces in gpu_long_context.LADDER:
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        rows[name] = float(cells[2])
        assert float(cells[4]) > 0  # the step ran
    first, last = gpu_long_context.LADDER[0][0], gpu_long_context.LADDER[-1][0]
    assert 0 < rows[last] <= rows[first]


def test_ladder_script_runs_end_to_end(tmp_path):
    """The simulated ladder behind docs/longest_context.md, on a tiny model with small budgets:
    one row per rung, in order, each with its peaks, both budgets' longest sequences and a step
    time; the table and the JSON written. Two rungs at a time, in the estimate's forked pool."""
    import json

    from hf_offload.tools.benchmarks import ladder

    argv = ["--preset", "tiny", "--lengths", "128", "256", "512", "--memory-gib", "0.085", "0.09",
            "--granularity", "128", "--jobs", "2", "--out", str(tmp_path)]  # fmt: skip
    assert ladder.main(argv) == 0
    rows = json.loads((tmp_path / "ladder.json").read_text())
    assert [row["rung"] for row in rows] == [name for name, _pieces in ladder.LADDER]
    for row in rows:
        small, large = (row["longest"][budget] for budget in ladder.BUDGETS)
        assert 0 < small < large
        assert row["step_seconds_at_long"] > 0
    table = (tmp_path / "ladder.md").read_text()
    assert all(f"| {row['rung']} |" in table for row in rows)


def test_gpu_long_context_qlora_stage_runs_on_the_cpu(capsys):
    """The QLoRA stage end to end on the CPU path: a 4-bit base quantized by bitsandbytes (its CPU
    backend), LoRA r=32, the tiled recipe at two lengths, each step beside the simulator's."""
    pytest.importorskip("bitsandbytes")
    assert gpu_long_context.main(["--cpu-smoke", "--stages", "qlora", "--qlora-lengths", "256", "512"]) == 0
    out = capsys.readouterr().out
    assert "== 3c. QLoRA: tiny in 4 bits, LoRA r=32, at 256 and 512 tokens" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 256 |", "| 512 |"))]
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[4]) > 0  # the simulated peak, the measured step time
    assert "| the CPU limit (256 MiB of byte accounting) |" in out


def test_grpo_table_cell_names_the_limit_that_set_it(tmp_path):
    """docs/trl.md's GRPO table, one cell on the tiny model (2,048 positions) with YaRN factor 2:
    the answer is the estimate's own (the scaled positions less the prompt, on a card where memory
    is no limit), the cell names rope scaling as what set it, and the rendered table shows that
    with the cell's command."""
    import json

    from hf_offload.tools.benchmarks import grpo_table

    args = ["estimate", "--preset", "tiny", "--lora-rank", "16", "--trainer", "grpo", "--device", "rtx4090",
            "--modes", grpo_table.MODE, "--prompt-length", "64", "--rope-scaling", "yarn:2:2048"]  # fmt: skip
    found = {"cell": ["rtx4090", "lora", "generate"], **grpo_table.cell(args)}
    assert found["max_seq_len"] == 2 * 2048 - 64
    scaled = "original_max_position_embeddings 2,048 x yarn factor 2 = 4,096"
    assert found["limit"] == f"rope scaling: {scaled}"
    assert found["limited_by"].startswith(f"the model's positions ({scaled})")
    (tmp_path / "grpo_table.jsonl").write_text(json.dumps(found) + "\n")
    (tmp_path / "grpo_table.meta.json").write_text(json.dumps({"date": "2026-12-08", "versions": {"trl": "1.16.0"}}))
    assert grpo_table.main(["--out", str(tmp_path), "--render"]) == 0
    rendered = (tmp_path / "grpo_table.md").read_text()
    assert f"| RTX 4090 (24 GB) | LoRA | {found['max_seq_len']:,} (the model's positions with yarn: 4,096;" in rendered
    assert f"`{found['command']}`" in rendered
