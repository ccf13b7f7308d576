"""`hf-offload bench` and `hf-offload estimate` from the command line."""

from __future__ import annotations

import json

import pytest
import torch

import hf_offload.tools.bench as bench
from hf_offload.tools import modes
from hf_offload.tools.cli import main


def run_bench(tmp_path, *extra):
    argv = ["bench", "--seq-lens", "32", "64", "--steps", "1", "--no-progress", "--out", str(tmp_path), *extra]
    assert main(argv) == 0
    return json.loads((tmp_path / "bench.json").read_text())


def test_bench_writes_json_table_and_plot(tmp_path):
    result = run_bench(
        tmp_path,
        "--modes",
        "none",
        "hf_offload",
        "checkpointing",
        "checkpointing+hf_offload",
        "--min-offload-bytes",
        "0",
    )
    records = {(r["mode"], r["seq_len"]): r for r in result["records"]}
    assert len(records) == 8 and all(r["status"] == "ok" for r in records.values())
    assert "CPU (byte accounting" in result["setup"]
    for seq in (32, 64):
        none, ours = records["none", seq], records["hf_offload", seq]
        assert ours["offloaded_bytes"] > 0 and ours["host_bytes"] >= ours["offloaded_bytes"]
        assert ours["resident_activation_bytes"] < none["resident_activation_bytes"]
        assert records["checkpointing", seq]["resident_activation_bytes"] < none["resident_activation_bytes"]
        assert none["peak_device_bytes"] is None  # no device memory on the CPU: not invented
        assert none["tokens_per_second"] > 0
    # Resident bytes grow with the sequence without offloading.
    assert records["none", 64]["resident_activation_bytes"] > 1.8 * records["none", 32]["resident_activation_bytes"]
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    table = (tmp_path / "bench.md").read_text()
    assert "| hf_offload | 64 |" in table


def test_a_mode_stops_at_its_first_out_of_memory(tmp_path, monkeypatch):
    measure = bench._measure

    def out_of_memory_from_64(model, mode, seq_len, *args):
        if mode == "hf_offload" and seq_len >= 64:
            raise torch.OutOfMemoryError("simulated")
        return measure(model, mode, seq_len, *args)

    monkeypatch.setattr(bench, "_measure", out_of_memory_from_64)
    result = run_bench(tmp_path, "--seq-lens", "32", "64", "128", "--modes", "none", "hf_offload")
    statuses = {(r["mode"], r["seq_len"]): r["status"] for r in result["records"]}
    assert statuses["hf_offload", 32] == "ok"
    assert statuses["hf_offload", 64] == "oom"
    assert statuses["hf_offload", 128] == "skipped: out of memory at a shorter length"
    assert statuses["none", 128] == "ok"


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["estimate", "--seq-len", "0"], "seq-len must be >= 2, got 0"),
        (["estimate", "--link-gbps", "-3"], "link-gbps must be > 0, got -3.0"),
        (["estimate", "--preset", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["bench", "--modes", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bad_arguments_are_named(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


def test_gpu_check_ratios_are_against_the_same_length():
    from hf_offload.tools.bench import Record
    from hf_offload.tools.benchmarks.gpu_check import ratios_table

    def record(mode, seq, peak, seconds):
        return Record(mode, seq, "ok", peak_device_bytes=peak, step_seconds=seconds)

    table = ratios_table(
        [
            record("none", 4096, 100, 1.0),
            record("checkpointing", 4096, 20, 1.3),
            record("checkpointing+hf_offload", 4096, 10, 1.339),
            record("none", 16384, 400, 4.0),
        ],
        [4096, 16384],
    )
    assert "| 4096 | checkpointing+hf_offload | 0.100x | 1.339x | 1.030x | - | - |" in table
    assert "| 16384 | none | 1.000x | 1.000x | - | - | - |" in table


def test_bench_without_matplotlib_still_writes_json_and_table(tmp_path, monkeypatch, capsys):
    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(bench, "plot", no_matplotlib)
    result = run_bench(tmp_path, "--seq-lens", "32", "--modes", "none")
    assert result["records"][0]["status"] == "ok"
    assert (tmp_path / "bench.md").exists() and not (tmp_path / "bench.png").exists()
    assert "pip install 'hf-offload[bench]'" in capsys.readouterr().out


class OlderTransformersModel:
    """A model of a transformers release with only gradient_checkpointing_* (5.17 on the lent GPU
    machine): what set_checkpointing is asked to do there."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.calls.append(("enable", gradient_checkpointing_kwargs))

    def gradient_checkpointing_disable(self):
        self.calls.append(("disable",))


def test_checkpointing_on_transformers_without_activation_checkpointing_api():
    model = OlderTransformersModel()
    modes.set_checkpointing(model, True)
    modes.set_checkpointing(model, False)
    assert model.calls == [("enable", {"use_reentrant": False}), ("disable",)]
    # offload=True does not exist there: the sweep records the mode as skipped, with the reason.
    with pytest.raises(ImportError, match=r"has no activation_checkpointing_enable\(offload=True\)"):
        modes.set_checkpointing(model, True, offload=True)


# -- TRL's offloading as the bench runs it, with a PEFT model -------------------------------------


def micro_peft_model():
    """Small enough that every tensor autograd saves at 4 tokens is under TRL's 1 KiB offloading
    threshold: TRL keeps them all in place, and never asks for pinned memory, which a CPU-only
    machine cannot give."""
    from conftest import tiny_model
    from peft import LoraConfig, get_peft_model

    model = tiny_model(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       vocab_size=32)  # fmt: skip
    return get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))


@pytest.fixture
def trl_reaches_its_logging_on_a_cpu(monkeypatch):
    """TRL 1.16's offloading logs through accelerate's logger in two places only: when it finds no
    output head (not the case with a PEFT model: PEFT's LoraModel forwards `lm_head`), and at the
    first unpack of the first backward when more than 60% of the host's RAM is in use
    (`verify_sufficient_virtual_memory`). The second is what failed on the H200, after earlier modes
    had left tens of GB pinned. On a CPU-only machine TRL fails before that for reasons of its own:
    `torch.accelerator.current_accelerator()` is None there, `torch.cpu.Stream` has no
    `synchronize`, and `torch.cpu` has no `empty_cache` (which TRL calls at every step once
    bitsandbytes is imported, as PEFT does when it is installed). Those three are patched to what
    an accelerator provides (the CPU is the device, with nothing to wait for and no cache to
    empty), RAM use is reported as 99% so that the logging path runs on any
    machine, and accelerate's process-wide state is emptied for the test (and restored after), so
    that what an earlier test created cannot make this one pass."""
    import collections

    import psutil
    from accelerate import PartialState

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cpu"))
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: collections.namedtuple("Memory", "percent")(99.0))
    monkeypatch.setattr(PartialState, "_shared_state", {})
    return PartialState


def trl_step(model) -> bench.Record:
    (record,) = bench.sweep(
        model, modes=["trl_offload"], seq_lens=[4], batch_size=1, steps=1, device=torch.device("cpu"), progress=False
    )
    return record


def test_trl_offloading_of_a_peft_model_gets_the_accelerate_state_it_logs_through(
    trl_reaches_its_logging_on_a_cpu, caplog
):
    record = trl_step(micro_peft_model())
    assert record.status == "ok"
    assert "of virtual memory used" in caplog.text, "TRL's logging path was not reached"
    assert trl_reaches_its_logging_on_a_cpu._shared_state, "the bench did not create accelerate's state"


def test_without_the_accelerate_state_trl_offloading_fails_as_on_the_h200(
    trl_reaches_its_logging_on_a_cpu, monkeypatch
):
    # Companion: the same step with the bench's setup removed fails with the error seen on the H200.
    monkeypatch.setattr(bench, "_accelerate_state", lambda: None)
    record = trl_step(micro_peft_model())
    assert record.status.startswith("failed: RuntimeError: You must initialize the accelerate state")


@pytest.mark.parametrize("mode", ["trl_offload", "transformers_offload"])
def test_without_an_accelerator_the_peers_offloading_is_skipped_as_needing_one(monkeypatch, mode):
    """TRL's offloading reads the accelerator's type (None here: "'NoneType' object has no attribute
    'type'"), transformers' offload=True pins host memory: on a machine without an accelerator the
    bench says so instead of printing their errors."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: None)
    (record,) = bench.sweep(
        micro_peft_model(), modes=[mode], seq_lens=[4], batch_size=1, steps=1, device=torch.device("cpu"),
        progress=False,
    )  # fmt: skip
    why = modes.NEEDS_ACCELERATOR[mode]
    assert record.status == f"skipped: {mode} needs an accelerator, and there is none here: {why}"


def test_without_the_skip_trl_offloading_fails_with_its_own_error(monkeypatch):
    """Companion: what a user saw before (TRL's raw error), with the check patched away."""
    from accelerate import PartialState

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "NEEDS_ACCELERATOR", {})
    monkeypatch.setattr(PartialState, "_shared_state", {})  # process-wide: not left to later tests
    record = trl_step(micro_peft_model())
    assert record.status == "failed: AttributeError: 'NoneType' object has no attribute 'type'"
    assert PartialState._shared_state, "the state is created before TRL is called"


def test_trl_hooks_come_off_when_the_mode_changes(trl_reaches_its_logging_on_a_cpu):
    model = micro_peft_model()
    head = model.get_base_model().lm_head
    bench._configure(model, "trl_offload", torch.device("cpu"))
    # TRL puts a no-op saved-tensor context around the head; left there, it would hide the head's
    # saved tensors from the byte accounting of every later mode.
    assert len(head._forward_pre_hooks) == 1 and len(head._forward_hooks) == 1
    bench._configure(model, "none", torch.device("cpu"))
    assert not head._forward_pre_hooks and not head._forward_hooks and not head._forward_hooks_always_called


def test_budget_modes_keep_layers_within_a_cpu_memory_limit(tmp_path):
    """On the CPU the _auto modes budget the decoder layers with --memory-limit (the byte
    accounting's limit) less what the step saves outside them: with room for part of the
    activations they keep some layers on the device and offload the rest, and the step's
    resident bytes stay within the limit where full offloading fits."""
    seqs = ["--seq-lens", "256", "--min-offload-bytes", "0"]
    full = run_bench(tmp_path / "full", *seqs, "--modes", "none", "hf_offload")["records"]
    none, offloaded = (r["resident_activation_bytes"] for r in full)
    limit = (none + offloaded) / 2  # between full offloading and none
    result = run_bench(
        tmp_path / "auto", *seqs, "--modes", "hf_offload_auto", "checkpointing+hf_offload_auto",
        "--memory-limit", str(limit / 2**30),
    )  # fmt: skip
    auto, checkpointed = result["records"]
    assert auto["status"] == "ok" and checkpointed["status"] == "ok"
    assert 0 < auto["device_budget_bytes"] < limit
    assert 0 < auto["layers_kept_for_budget"] < 5  # some of the 5 offloadable layers, not all
    assert offloaded < auto["resident_activation_bytes"] <= limit
    assert auto["offloaded_bytes"] < full[1]["offloaded_bytes"]  # it moved less than full offloading
    assert checkpointed["layers_kept_for_budget"] == 5  # checkpoint inputs all fit: nothing moves
    assert checkpointed["offloaded_bytes"] == 0
    assert "layers kept" in (tmp_path / "auto" / "bench.md").read_text()


def test_budget_modes_need_a_memory_figure_on_the_cpu(tmp_path):
    result = run_bench(tmp_path, "--seq-lens", "32", "--modes", "hf_offload_auto")
    (record,) = result["records"]
    assert record["status"].startswith("skipped: hf_offload_auto reads the device's free memory")


def test_bench_simulate_puts_the_simulators_peak_beside_each_record(tmp_path):
    """With --simulate (the default on CUDA), every step the bench ran is simulated too, with the
    same model, dtype and adapters; the budget modes, which read a real device, are left out."""
    result = run_bench(tmp_path, "--modes", "none", "checkpointing+hf_offload", "--lora-rank", "4", "--simulate")
    records = result["records"]
    assert all(r["simulated_peak_bytes"] > 0 for r in records)
    by_mode = {(r["mode"], r["seq_len"]): r["simulated_peak_bytes"] for r in records}
    assert by_mode["none", 64] > by_mode["none", 32]
    assert "simulated peak GiB | measured / simulated" in (tmp_path / "bench.md").read_text()


def test_the_simulated_setup_is_the_benchmarked_one():
    from peft import LoraConfig, get_peft_model

    from hf_offload.tools.fidelity import training_of
    from hf_offload.tools.presets import preset_config

    model = bench.build_on_device(preset_config("tiny"), torch.device("meta"), torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    training = training_of(model, device=torch.device("cpu"), batch_size=2)
    assert (training.lora_rank, training.lora_targets, training.lora_dtype) == (8, ("q_proj", "v_proj"), torch.float32)
    assert (training.dtype, training.batch_size, training.optimizer_states) == (torch.bfloat16, 2, 0)
