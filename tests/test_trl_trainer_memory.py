"""The simulator's TRL steps held to TRL's own trainers (TRL 1.16), not to our re-enactment of them:
SFTTrainer, DPOTrainer and GRPOTrainer train one real step on the CPU, and what the step allocates
(torch's profiler, `peak_allocated`) on top of the models the trainer keeps (the policy and, where
TRL loads one, its reference model) is what `hf-offload estimate --trainer` simulates for the same
setup: full fine-tuning and LoRA, with each setting that changes what TRL loads
(`precompute_ref_log_probs`, `ref_model`, `beta`, `sync_ref_model`).

GRPO's completions come from a `rollout_func` of fixed length (TRL's hook for custom generation),
so that the step has the simulated shape; its generation is held to transformers' `generate` in
tests/test_generation.py."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import quiet_training_args, tiny_model
from datasets import Dataset
from peft import LoraConfig
from test_trl import TOKENIZER, WORDS
from transformers import AutoModelForCausalLM

from hf_offload.tools.allocations import peak_allocated
from hf_offload.tools.simulator import Simulator, Training, TrlStep

PROMPT, COMPLETION = 12, 20
GENERATIONS = 2
# Wide enough that the reference model's weights are a tenth of what a step holds, small enough to
# train a step in a second; eager attention: no kernel whose CPU and CUDA versions allocate differently.
SHAPE = dict(hidden_size=96, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, attn_implementation="eager")  # fmt: skip

# case -> (trainer, LoRA, the trainer config's fields, DPO's ref_model given)
CASES = {
    "sft-full": ("sft", False, {}, False),
    "sft-lora": ("sft", True, {}, False),
    "dpo-full-loads-a-reference": ("dpo", False, {}, False),
    "dpo-full-synced-reference": ("dpo", False, {"sync_ref_model": True}, False),
    "dpo-full-precomputed": ("dpo", False, {"precompute_ref_log_probs": True}, False),
    "dpo-lora-adapters-disabled": ("dpo", True, {}, False),
    "dpo-lora-reference-given": ("dpo", True, {}, True),
    "grpo-full-beta-loads-a-reference": ("grpo", False, {"beta": 0.04}, False),
    "grpo-full-synced-reference": ("grpo", False, {"beta": 0.04, "sync_ref_model": True}, False),
    "grpo-full-beta-0": ("grpo", False, {"beta": 0.0}, False),
    "grpo-lora-beta-adapters-disabled": ("grpo", True, {"beta": 0.04}, False),
}


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def words(count: int, seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (count,), generator=generator))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved where TRL can load its reference model from (`config._name_or_path`)."""
    path = tmp_path_factory.mktemp("policy")
    tokens = dict(pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.bos_token_id,
                  eos_token_id=TOKENIZER.eos_token_id)  # fmt: skip
    tiny_model(vocab_size=len(TOKENIZER), **tokens, **SHAPE).save_pretrained(path)
    return path


def lora() -> LoraConfig:
    return LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")


def measured_step(trainer) -> tuple[int, dict]:
    """One real training step under torch's profiler: the most bytes it held beyond what was
    allocated before it (generation, scoring, forward, backward; not the optimizer's step), and the
    shapes of its inputs."""
    original = trainer.training_step
    found = {}

    def measured(model, inputs, num_items_in_batch=None):
        box = {}
        found["peak"], _ops = peak_allocated(
            lambda: box.setdefault("loss", original(model, inputs, num_items_in_batch)),
            ignore_bytes=torch.get_rng_state().nbytes,
        )
        return box["loss"]

    compute_loss = trainer.compute_loss

    def shapes(model, inputs, *args, **kwargs):  # the inputs as the loss sees them (GRPO's: generated)
        found["shapes"] = {key: tuple(value.shape) for key, value in inputs.items() if isinstance(value, torch.Tensor)}
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.training_step = measured
    trainer.compute_loss = shapes
    trainer.train()
    return found["peak"], found["shapes"]


def resident_bytes(*models) -> int:
    return sum(t.numel() * t.element_size() for m in models if m is not None for t in (*m.parameters(), *m.buffers()))


def real_trainer(case: str, saved, tmp_path):
    """The trainer of `case` after one step, with what the step held beyond the models, the models'
    bytes and the sequence length it ran."""
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    trainer_name, peft, fields, give_reference = CASES[case]
    policy = AutoModelForCausalLM.from_pretrained(saved)
    common = quiet_training_args(tmp_path, max_steps=1, per_device_train_batch_size=1, bf16=False,
                                 activation_checkpointing=False)  # fmt: skip
    peft_config = lora() if peft else None
    if trainer_name == "sft":
        data = Dataset.from_dict({"text": [words(PROMPT + COMPLETION, seed) for seed in range(4)]})
        trainer = SFTTrainer(policy, args=SFTConfig(**common, max_length=1024), train_dataset=data,
                             processing_class=TOKENIZER, peft_config=peft_config)  # fmt: skip
    elif trainer_name == "dpo":
        # Completions start with a space, so that the prompt's tokens are a prefix of prompt+completion;
        # TRL appends eos to each: COMPLETION tokens.
        data = Dataset.from_dict({
            "prompt": [words(PROMPT, seed) for seed in range(4)],
            "chosen": [" " + words(COMPLETION - 1, 10 + seed) for seed in range(4)],
            "rejected": [" " + words(COMPLETION - 1, 20 + seed) for seed in range(4)],
        })  # fmt: skip
        reference = AutoModelForCausalLM.from_pretrained(saved) if give_reference else None
        trainer = DPOTrainer(policy, ref_model=reference, args=DPOConfig(**common, max_length=1024, **fields),
                             train_dataset=data, processing_class=TOKENIZER, peft_config=peft_config)  # fmt: skip
    else:
        common["per_device_train_batch_size"] = GENERATIONS

        def rollout(prompts, trainer):
            ids = [TOKENIZER(prompt)["input_ids"] for prompt in prompts]
            completion = TOKENIZER(words(COMPLETION, 5))["input_ids"]
            return {"prompt_ids": ids, "completion_ids": [list(completion) for _ in prompts], "logprobs": None}

        data = Dataset.from_dict({"prompt": [words(PROMPT, seed) for seed in range(4)]})
        config = GRPOConfig(**common, num_generations=GENERATIONS, max_completion_length=COMPLETION, **fields)
        trainer = GRPOTrainer(policy, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                              args=config, train_dataset=data, processing_class=TOKENIZER, peft_config=peft_config,
                              rollout_func=rollout)  # fmt: skip
    peak, shapes = measured_step(trainer)
    return trainer, peak, shapes


def simulated(case: str, config, shapes: dict, *, loads_reference=None) -> tuple[int, int, int]:
    """The same step simulated (TRL's CPU fallback head, float32, no optimizer step): its peak
    with what is resident, what is resident, and the length simulated."""
    trainer_name, peft, fields, give_reference = CASES[case]
    if trainer_name == "sft":
        step, batch, length = TrlStep("sft", kernel="torch"), 1, shapes["input_ids"][1]
    elif trainer_name == "dpo":
        step = TrlStep("dpo", prompt_length=PROMPT, ref_model=give_reference, kernel="torch",
                       precompute_ref_log_probs=fields.get("precompute_ref_log_probs", False),
                       sync_ref_model=fields.get("sync_ref_model", False))  # fmt: skip
        batch, length = 1, shapes["input_ids"][1] - PROMPT
    else:
        step = TrlStep("grpo", prompt_length=shapes["prompt_ids"][1], num_generations=GENERATIONS,
                       generation_batch_size=GENERATIONS, grpo_beta=fields["beta"], kernel="torch",
                       sync_ref_model=fields.get("sync_ref_model", False))  # fmt: skip
        batch, length = GENERATIONS, shapes["completion_ids"][1]
    training = Training(dtype=torch.float32, lora_rank=4 if peft else None, lora_dtype=torch.float32,
                        batch_size=batch, trl=step)  # fmt: skip
    if loads_reference is not None:
        TrlStep.loads_reference, saved_method = loads_reference, TrlStep.loads_reference
    try:
        simulator = Simulator(config, training)
    finally:
        if loads_reference is not None:
            TrlStep.loads_reference = saved_method
    result = simulator.run("none", length)
    return result.tracked_peak_bytes, simulator.resident_bytes, length


@pytest.mark.parametrize("case", list(CASES))
def test_simulated_trl_step_holds_what_trls_own_trainer_holds(case, saved, tmp_path):
    """The models TRL keeps on the device (the policy, its adapters, and where TRL loads or is given
    one, the reference model) are the simulator's to the byte, and with the step's own peak on top
    they are within 1% of what TRL's trainer held on the CPU."""
    trainer, peak, shapes = real_trainer(case, saved, tmp_path)
    reference = getattr(trainer, "ref_model", None)
    models = resident_bytes(trainer.model, reference)
    simulated_peak, simulated_resident, _length = simulated(case, trainer.model.config, shapes)
    _trainer, peft, fields, given = CASES[case]
    if _trainer != "sft":  # which setups keep a reference model: TrlStep's rule, read from the trainer
        step = TrlStep(_trainer, ref_model=given, grpo_beta=fields.get("beta", 0.0),
                       precompute_ref_log_probs=fields.get("precompute_ref_log_probs", False))  # fmt: skip
        assert step.loads_reference(peft) == (reference is not None)
    assert simulated_resident == models
    assert simulated_peak == pytest.approx(models + peak, rel=0.01)


def test_without_the_reference_model_the_check_fails(saved, tmp_path):
    """Companion: the simulator as it was before it counted TRL's reference model (the policy alone
    resident) misses DPOTrainer's full fine-tuning by the reference copy: the check above fails."""
    trainer, peak, shapes = real_trainer("dpo-full-loads-a-reference", saved, tmp_path)
    assert trainer.ref_model is not None
    models = resident_bytes(trainer.model, trainer.ref_model)
    simulated_peak, simulated_resident, _ = simulated("dpo-full-loads-a-reference", trainer.model.config, shapes,
                                                      loads_reference=lambda self, peft: False)  # fmt: skip
    assert simulated_resident == resident_bytes(trainer.model)
    assert simulated_peak < (models + peak) * 0.99
