"""transformers.Trainer: train() then evaluate(), identical to the same run without offloading."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, RandomTokens, quiet_training_args, tiny_model, twin
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

import hf_offload


def run_trainer(model, tmp_path, checkpointing):
    args = TrainingArguments(**quiet_training_args(tmp_path, activation_checkpointing=checkpointing))
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(6, 0), eval_dataset=RandomTokens(4, 100))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_train_then_evaluate(tmp_path, tuning, checkpointing):
    base = tiny_model()
    plain, offloaded = base, twin(base)
    offloaded.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
    if tuning == "lora":
        config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        torch.manual_seed(3)
        plain = get_peft_model(plain, config)
        torch.manual_seed(3)
        offloaded = get_peft_model(offloaded, config)

    _, expected_losses = run_trainer(plain, tmp_path / "plain", checkpointing)
    trainer, losses = run_trainer(offloaded, tmp_path / "offloaded", checkpointing)
    assert len(losses) == 3
    assert losses == expected_losses
    for (name, p), (_, q) in zip(plain.named_parameters(), offloaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name

    stats = hf_offload.activation_offloading_stats(offloaded)
    assert stats.offloaded_tensors > 0
    before = stats.total_layer_scopes, stats.total_pack_calls
    metrics = trainer.evaluate()
    after = hf_offload.activation_offloading_stats(offloaded)
    assert (after.total_layer_scopes, after.total_pack_calls) == before, "evaluation did offloading work"
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    assert metrics["eval_loss"] < 2 * torch.log(torch.tensor(float(VOCAB)))
