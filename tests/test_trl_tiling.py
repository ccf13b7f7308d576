"""TRL's trainers on a tiled, offloaded model: TRL 1.16's SFT, DPO and GRPO trainers compute their
loss through TRL's fused LM head (`add_fused_lm_head`; `model(..., fused_lm_head=True)` runs the
backbone and scores its last hidden states), past the tiled loss head. Tiling keeps the layers'
parts and the final norm, which runs a slice at a time there; the runs log what the untiled runs
log (close: slices round differently), and tiling says once that the loss head is TRL's.

Tiny models, 2 steps, slices of 4 tokens."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import enable_sim, twin
from test_grpo import compared, run_grpo, saved_model
from test_trl import TOKENIZER, common_args, dpo_dataset, lm_model, logged, run_sft
from trl import DPOConfig, DPOTrainer

import hf_offload

TILE = 4
STEPS = 2


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread on a busy two-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiled_twin(model):
    tiled = twin(model)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    enable_sim(tiled)
    return tiled


def assert_close_logs(actual: list[dict], reference: list[dict], rel: float = 2e-4) -> None:
    # float32 sums taken in another order by the slices: grad_norm moves by about 3e-5 relative here
    # (1e-5 fails on it), the losses by about 1e-7.
    assert [sorted(entry) for entry in actual] == [sorted(entry) for entry in reference]
    assert any("loss" in entry for entry in actual)
    for mine, theirs in zip(actual, reference, strict=True):
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=rel, abs=1e-6), key


def norm_widths(monkeypatch, model) -> list[tuple[int, bool]]:
    """(tokens, grad enabled) of each run of the final norm's forward (its class's), in order."""
    norm, widths = model.model.norm, []
    original = type(norm).forward

    def spying(self, x):
        if self is norm:
            widths.append((x.shape[1], torch.is_grad_enabled()))
        return original(self, x)

    monkeypatch.setattr(type(norm), "forward", spying)
    return widths


def notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hf_offload" and "fused LM head" in r.getMessage()]


def test_sft_trainer_tiles_the_final_norm_under_trls_fused_head(tmp_path, monkeypatch, caplog):
    """SFTTrainer: TRL's fused head scores the backbone's last hidden states. The final norm before
    it runs a slice at a time in forward and its backward (never the whole sequence with grad on),
    the logs are close to the untiled run's, and tiling says once that the loss head is TRL's."""
    plain = lm_model()
    tiled = tiled_twin(plain)
    torch.manual_seed(3)
    expected = run_sft(plain, tmp_path / "plain", max_steps=STEPS, activation_checkpointing=False)
    widths = norm_widths(monkeypatch, tiled)
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        trainer = run_sft(tiled, tmp_path / "tiled", max_steps=STEPS, activation_checkpointing=False)
    assert_close_logs(logged(trainer), logged(expected))
    with_grad = [tokens for tokens, grad in widths if grad]
    assert with_grad and max(with_grad) <= TILE, widths
    assert len(with_grad) > 2 * STEPS  # more than one slice a step, in forward and in backward
    said = notices(caplog)
    assert len(said) == 1 and "loss head is TRL's" in said[0] and "final norm" in said[0], said


def test_the_notice_is_not_given_where_our_loss_head_runs(caplog):
    """Companion: a plain training step with labels runs the tiled loss head; no notice."""
    model = lm_model()
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    ids = torch.randint(4, len(TOKENIZER), (2, 12), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert notices(caplog) == []


def test_dpo_trainer_on_a_tiled_model_logs_the_untiled_run(tmp_path, monkeypatch):
    """DPOTrainer (chosen and rejected in one policy forward, the reference forward under no_grad):
    close to the untiled run, the final norm a slice at a time wherever grad is on."""
    plain = lm_model()
    tiled = tiled_twin(plain)
    trainers = {}
    for name, model in (("plain", plain), ("tiled", tiled)):
        widths = norm_widths(monkeypatch, model) if name == "tiled" else []
        args = DPOConfig(**common_args(tmp_path / name), activation_checkpointing=False, bf16=False)
        args.max_steps = STEPS
        torch.manual_seed(3)
        trainers[name] = DPOTrainer(
            model=model, ref_model=twin(model), args=args, train_dataset=dpo_dataset(), processing_class=TOKENIZER
        )
        trainers[name].train()
    assert_close_logs(logged(trainers["tiled"]), logged(trainers["plain"]))
    with_grad = [tokens for tokens, grad in widths if grad]
    assert with_grad and max(with_grad) <= TILE, widths


def test_grpo_trainer_on_a_tiled_model_logs_the_untiled_run(tmp_path, monkeypatch):
    """GRPOTrainer (generation and the reference forward under no_grad, the policy's loss through
    TRL's fused head): the same completions sampled, logs close to the untiled run, the final norm
    a slice at a time wherever grad is on."""
    base = saved_model(tmp_path / "model")
    tiled = tiled_twin(base)
    expected, expected_seen, _ = run_grpo(base, tmp_path / "plain", checkpointing=False)
    widths = norm_widths(monkeypatch, tiled)
    trainer, seen, _ = run_grpo(tiled, tmp_path / "tiled", checkpointing=False)
    assert seen == expected_seen
    assert_close_logs(compared(logged(trainer)), compared(logged(expected)))
    with_grad = [tokens for tokens, grad in widths if grad]
    assert with_grad and max(with_grad) <= TILE, widths
