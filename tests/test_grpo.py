"""TRL's GRPOTrainer on a model whose offloading we enabled: the run logs exactly what the same
run without offloading logs, and the engine does no work while the trainer generates.

What GRPOTrainer (TRL 1.16, no vLLM, no continuous batching) does each step, read from its
source and checked by the spy below: `_generate_single_turn` calls the model's own
`generate()` inside `unwrap_model_for_generation(...)` and `torch.no_grad()`. The model stays in
training mode (no `eval()`); TRL switches gradient checkpointing off around generation and back
on after it. The reference log-probs (beta > 0) come from a forward under `torch.no_grad()` too:
of a separate reference model (full fine-tuning; TRL loads it from the policy's
`config._name_or_path`) or of the same model with its LoRA adapter disabled. Only the policy's
loss forward runs with grad enabled. hf_offload enters its scope only for a training forward
with grad enabled, so generation and the reference forward pass through untouched.

Generation is TRL's default sampling (do_sample=True, temperature 1.0), made repeatable by the
trainer's seed: both runs sample the same completions, which the reward function records.

GRPOConfig in TRL 1.16 has no `activation_offloading` field (TRL's own offloading exists only
for SFT, DPO, KTO and Reward): `GRPOConfig(activation_offloading=True)` is a TypeError, so there
is no "both on" case to test here."""

from __future__ import annotations

import pytest
import torch
from conftest import enable_sim, quiet_training_args, twin
from datasets import Dataset
from test_trl import LAYERS, TOKENIZER, assert_same_trainable_weights, lm_model, logged, lora_config, sentences
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

import hf_offload

STEPS = 3
GENERATIONS = 2
COMPLETION = 6
BETA = 0.1
COUNTERS = ("total_layer_scopes", "total_pack_calls", "total_unpack_calls")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy two-core machine the
    threads' spin-waits made each small matmul up to 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def counters(model) -> dict[str, int]:
    stats = hf_offload.activation_offloading_stats(model)
    return {name: getattr(stats, name) for name in COUNTERS}


class GenerationSpy:
    """Wraps the trainer's model.generate (an instance attribute, which TRL's unwrapped model
    resolves to) and records the engine's lifetime counters around each call, with the grad mode
    and training flag generation ran under."""

    def __init__(self, model, offloaded) -> None:
        self.calls: list[dict] = []
        self._generate = model.generate
        self._offloaded = offloaded

        def generate(*args, **kwargs):
            before = counters(self._offloaded)
            call = {"grad_enabled": torch.is_grad_enabled(), "training": model.training}
            output = self._generate(*args, **kwargs)
            after = counters(self._offloaded)
            call["work"] = {name: after[name] - before[name] for name in COUNTERS}
            self.calls.append(call)
            return output

        model.generate = generate


def grpo_dataset() -> Dataset:
    return Dataset.from_dict({"prompt": sentences(8, 2, (3, 6))})


def run_grpo(model, output_dir, *, offloaded=None, peft_config=None, checkpointing=True, wrap_generate=None):
    """Three GRPO steps, 2 completions of at most 6 tokens per prompt, KL to the reference
    (beta > 0). Returns the trainer, the completions the reward function saw, and the spy (when
    `offloaded` names the model whose engine to watch)."""
    seen: list[list[str]] = []

    def reward(completions, **kwargs):
        seen.append(list(completions))
        return [float(c.count("cat") + c.count("dog")) - 0.1 * len(c.split()) for c in completions]

    args = GRPOConfig(
        **quiet_training_args(output_dir, max_steps=STEPS, per_device_train_batch_size=GENERATIONS),
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        beta=BETA,
        bf16=False,
        activation_checkpointing=checkpointing,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=grpo_dataset(),
        processing_class=TOKENIZER,
        peft_config=peft_config,
    )
    if wrap_generate is not None:
        wrap_generate(trainer.model)
    spy = GenerationSpy(trainer.model, offloaded) if offloaded is not None else None
    trainer.train()
    return trainer, seen, spy


def compared(entries: list[dict]) -> list[dict]:
    """The log without GRPO's step_time, which measures time, not the computation."""
    return [{key: value for key, value in entry.items() if key != "step_time"} for entry in entries]


def saved_model(directory):
    """A tiny Llama saved to and loaded from `directory`: GRPOTrainer builds the reference model
    of a full fine-tuning run from the policy's config._name_or_path, which must be a local path
    here (no downloads)."""
    lm_model().save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_grpo_trainer_logs_identical_losses(tmp_path, tuning, checkpointing):
    """GRPOTrainer with a KL term (beta > 0), so every step generates, scores, runs the reference
    forward and then the policy forward and backward: full fine-tuning (separate reference model)
    and LoRA (reference = the offloaded model with its adapter disabled), with and without TRL's
    default gradient checkpointing (which TRL turns off and on again around each generation).
    The sampled completions, every logged value except step_time (loss, KL, rewards, entropy,
    clip ratios, completion lengths) and the trained weights equal those of the run without
    offloading."""
    base = saved_model(tmp_path / "model") if tuning == "full" else lm_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    peft = lora_config if tuning == "lora" else lambda: None
    expected, expected_seen, _ = run_grpo(plain, tmp_path / "plain", peft_config=peft(), checkpointing=checkpointing)
    trainer, seen, spy = run_grpo(
        offloaded, tmp_path / "offloaded", offloaded=offloaded, peft_config=peft(), checkpointing=checkpointing
    )

    assert len(seen) == STEPS and all(len(group) == GENERATIONS for group in seen)
    assert seen == expected_seen, "the two runs sampled different completions"
    assert len({c for group in seen for c in group}) > 1, "generation produced nothing to compare"
    losses = [entry for entry in compared(logged(trainer)) if "loss" in entry]
    assert len(losses) == STEPS
    # The KL to the reference is logged every step; it is 0 at the first step of full fine-tuning
    # (policy = reference) and grows once the policy has moved.
    assert all("kl" in entry for entry in losses) and losses[-1]["kl"] > 0, "the reference forward did not run"
    assert compared(logged(trainer)) == compared(logged(expected))
    assert_same_trainable_weights(expected.model, trainer.model)
    if tuning == "full":
        assert trainer.ref_model is not None
    else:
        assert trainer.ref_model is None  # the reference is the adapter-disabled offloaded model

    # Only the policy's loss forward (one per step) opened layer scopes: generation and the
    # reference forward did no offloading work.
    assert len(spy.calls) == STEPS
    assert all(not any(call["work"].values()) for call in spy.calls), spy.calls
    stats = hf_offload.activation_offloading_stats(offloaded)
    assert stats.total_layer_scopes == STEPS * LAYERS
    assert stats.layers_offloaded == LAYERS - 1
    assert stats.offloaded_tensors > 0
    if checkpointing:  # still offloaded checkpointing after TRL re-enabled checkpointing
        # With LoRA the first layer's input is the frozen embeddings' output, made to require grad
        # (a leaf of the graph): layer 0 takes it detoured, so it is offloaded like the others.
        assert stats.kept_tensors["leaf"] == 0
        assert stats.offloaded_tensors == LAYERS - 1
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


def test_generation_runs_in_training_mode_without_grad_and_offloads_nothing(tmp_path):
    """What the engine sees of GRPO's generation: model.generate is called STEPS times with the
    model in training mode and grad disabled, and the engine's lifetime counters (layer scopes,
    pack and unpack calls) do not move during any call, while between the calls the policy's
    forward and backward offload."""
    model = lm_model()
    enable_sim(model)
    _, _, spy = run_grpo(model, tmp_path, offloaded=model, peft_config=lora_config())
    assert [(call["training"], call["grad_enabled"]) for call in spy.calls] == [(True, False)] * STEPS
    assert [call["work"] for call in spy.calls] == [dict.fromkeys(COUNTERS, 0)] * STEPS
    totals = counters(model)
    assert totals["total_layer_scopes"] == STEPS * LAYERS
    assert totals["total_pack_calls"] > 0 and totals["total_unpack_calls"] > 0


def test_generation_spy_sees_offloading_work_inside_generate(tmp_path):
    """Companion: a generation path that ran a grad-enabled training forward (what generation
    without TRL's no_grad and without generate's own would do) shows up in the spy's counters,
    so the zero deltas above are a measurement, not a blind spot."""
    model = lm_model()
    enable_sim(model)

    def leaky(trainer_model):
        generate = trainer_model.generate

        def generate_with_grad(*args, **kwargs):
            with torch.enable_grad():
                trainer_model(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"])
            return generate(*args, **kwargs)

        trainer_model.generate = generate_with_grad

    _, _, spy = run_grpo(model, tmp_path, offloaded=model, peft_config=lora_config(), wrap_generate=leaky)
    assert len(spy.calls) == STEPS
    assert all(call["work"]["total_layer_scopes"] == LAYERS for call in spy.calls), spy.calls
    assert all(call["work"]["total_pack_calls"] > 0 for call in spy.calls)


def test_grpo_config_has_no_trl_activation_offloading():
    """Recorded for docs/trl.md: TRL 1.16 offers its own offloading to SFT, DPO, KTO and Reward
    only; in GRPO the offloading is hf_offload's or none. If a TRL release adds the flag, this
    fails and the docs (and the both-on warning's coverage) need a look."""
    with pytest.raises(TypeError, match="activation_offloading"):
        GRPOConfig(output_dir="unused", use_cpu=True, activation_offloading=True)
