"""transformers.Trainer beyond train-then-evaluate (tests/test_trainer.py): gradient accumulation,
evaluation during training, saving a checkpoint and resuming from it. Each run's loss curve is
identical to the same run without offloading; and the example script runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import VOCAB, RandomTokens, enable_sim, quiet_training_args, run_example, tiny_model, twin
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_offload

LAYERS = 3  # tiny_model's num_hidden_layers


def with_lora(model: torch.nn.Module) -> PeftModel:
    torch.manual_seed(3)
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def make_pair(tuning: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = tiny_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    if tuning == "lora":
        plain, offloaded = with_lora(plain), with_lora(offloaded)
    return plain, offloaded


def arguments(output_dir: Path, **overrides) -> TrainingArguments:
    return TrainingArguments(**quiet_training_args(output_dir, **overrides))


def losses(trainer: Trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_same_parameters(plain: torch.nn.Module, offloaded: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(plain.named_parameters(), offloaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_gradient_accumulation(tmp_path, tuning):
    """gradient_accumulation_steps=2: two forward/backward passes per optimizer step, each one an
    offloading step of its own; losses and final weights identical to the run without."""
    plain, offloaded = make_pair(tuning)
    results = {}
    for name, model in (("plain", plain), ("offloaded", offloaded)):
        args = arguments(tmp_path / name, gradient_accumulation_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(12, 0))
        trainer.train()
        results[name] = losses(trainer)
    assert len(results["offloaded"]) == 3
    assert results["offloaded"] == results["plain"]
    assert_same_parameters(plain, offloaded)
    stats = hf_offload.activation_offloading_stats(offloaded)
    assert stats.total_layer_scopes == 3 * 2 * LAYERS  # steps x micro-batches x layers
    assert stats.offloaded_tensors > 0
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


class CountersAtEvents(TrainerCallback):
    """The engine's lifetime counters and last-step statistics at each step end and evaluation."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.events: list[tuple[str, int, int, int]] = []

    def record(self, event: str) -> None:
        stats = hf_offload.activation_offloading_stats(self.model)
        self.events.append((event, stats.total_layer_scopes, stats.total_pack_calls, stats.offloaded_tensors))

    def on_step_end(self, args, state, control, **kwargs):
        self.record("step")

    def on_evaluate(self, args, state, control, **kwargs):
        self.record("evaluate")


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_evaluation_during_training_does_no_offloading_work(tmp_path, tuning):
    """eval_strategy="steps", eval_steps=1: an evaluation after every step. Training and eval losses
    are identical to the run without offloading; each evaluation leaves the engine's lifetime
    counters (layer scopes, pack calls) and the last training step's statistics untouched."""
    plain, offloaded = make_pair(tuning)
    counters = CountersAtEvents(offloaded)
    results = {}
    for name, model in (("plain", plain), ("offloaded", offloaded)):
        args = arguments(tmp_path / name, eval_strategy="steps", eval_steps=1)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=RandomTokens(6, 0),
            eval_dataset=RandomTokens(4, 100),
            callbacks=[counters] if name == "offloaded" else [],
        )
        trainer.train()
        results[name] = losses(trainer), losses(trainer, "eval_loss")
    assert len(results["offloaded"][1]) == 3, "one evaluation per step"
    assert results["offloaded"] == results["plain"]
    assert_same_parameters(plain, offloaded)

    events = counters.events
    assert [event for event, *_ in events] == ["step", "evaluate"] * 3
    for (_, *at_step), (_, *at_evaluate) in zip(events[::2], events[1::2], strict=True):
        assert at_evaluate == at_step, "evaluation did offloading work or reset the step's statistics"
    assert [scopes for event, scopes, *_ in events if event == "step"] == [LAYERS, 2 * LAYERS, 3 * LAYERS]
    assert all(offloaded_tensors > 0 for *_, offloaded_tensors in events)
    assert torch.tensor(results["offloaded"][1]).lt(2 * torch.log(torch.tensor(float(VOCAB)))).all()


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_save_checkpoint_and_resume(tmp_path, tuning):
    """save_strategy="steps": a run of 4 steps saves checkpoint-2; a fresh model (offloading
    enabled again, as a user would) and a fresh Trainer resume from it. The uninterrupted and the
    resumed loss curves, the checkpoint files and the final weights are identical to the same
    runs without offloading; the resumed model still offloads."""
    curves, resumed_curves, finals, checkpoints = {}, {}, {}, {}
    for name in ("plain", "offloaded"):
        model = make_pair(tuning)[name == "offloaded"]
        args = arguments(tmp_path / name, max_steps=4, save_strategy="steps", save_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(8, 0))
        trainer.train()
        curves[name] = losses(trainer)
        checkpoint = tmp_path / name / "checkpoint-2"
        weights = "adapter_model.safetensors" if tuning == "lora" else "model.safetensors"
        checkpoints[name] = (checkpoint / weights).read_bytes()

        fresh = make_pair(tuning)[name == "offloaded"]
        args = arguments(tmp_path / f"{name}-resumed", max_steps=4, save_strategy="steps", save_steps=2)
        trainer = Trainer(model=fresh, args=args, train_dataset=RandomTokens(8, 0))
        trainer.train(resume_from_checkpoint=str(checkpoint))
        resumed_curves[name] = losses(trainer)
        finals[name] = fresh
        if name == "offloaded":
            assert fresh.is_activation_offloading
            stats = hf_offload.activation_offloading_stats(fresh)
            assert stats.total_layer_scopes == 2 * LAYERS  # only the two steps after the checkpoint ran
            assert stats.offloaded_tensors > 0
    assert len(curves["offloaded"]) == 4
    assert curves["offloaded"] == curves["plain"]
    assert resumed_curves["offloaded"] == resumed_curves["plain"]
    assert resumed_curves["offloaded"] == curves["offloaded"], "resuming changed the loss curve"
    assert checkpoints["offloaded"] == checkpoints["plain"]
    assert_same_parameters(finals["plain"], finals["offloaded"])


def test_trainer_lora_example_runs():
    result = run_example("trainer_lora.py", "--steps", "2", "--seq-len", "32", "--compare")
    assert result.returncode == 0, result.stderr
    assert "losses with offloading:" in result.stdout
    assert "deterministic kernels: none needed on cpu" in result.stdout
    assert "identical to the run without offloading: yes" in result.stdout
    assert "offloaded:" in result.stdout
