"""GRPO's step split across an SP group: UlyssesGRPOTrainer against TRL's GRPOTrainer on one process.

One launch of tests/grpo_ulysses_worker.py (2 CPU ranks, gloo, one SP group of 2, DDP) trains two
steps of UlyssesGRPOTrainer (tiny float64 Llama, hf_offload's offloading, sequence tiling and
checkpointing on; DAPO, beta > 0 with a reference model, num_iterations=2, scale_rewards="batch")
and replays TRL's compute_loss for every loss type GRPOConfig lists on the last step's inputs. Here,
on one process, TRL's own GRPOTrainer (no Ulysses, no offloading, no tiling) scores the same
completions at the same weights: the per-token log-probs (the policy's, the old and the reference
model's), the loss and the gradients the optimizer stepped with must match.

GRPO_ULYSSES_NPROC=4 runs the same on 4 ranks (one SP group of 4; ~1 min more on 2 cores, so not
in the suite's default run).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_distributed import launch

NPROC = int(os.environ.get("GRPO_ULYSSES_NPROC", "2"))  # the ranks, all one SP group
LAUNCH_TIMEOUT = 600  # a hang's guard; the launch takes ~40 s on 2 idle cores
# The model is float64, but TRL 1.16's fused LM head (trl/kernels/chunked_logprob.py) accumulates its
# logits and its backward in float32 and returns float32 log-probs: the gradients agree to float32's
# rounding (the slices' tokens are summed in another order); log-probs and losses came out equal.
LOGPS = 1e-6
LOSS = 1e-6
GRAD = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("grpo_ulysses") / "results.json"
    results = launch("grpo_ulysses_worker.py", out, env={"DS_ACCELERATOR": "cpu"}, nproc=NPROC, timeout=LAUNCH_TIMEOUT)
    return results, torch.load(out.parent / "tensors.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process(runs):
    """TRL's GRPOTrainer on one process, with the worker's configuration and its saved model."""
    from datasets import Dataset
    from grpo_ulysses_worker import grpo_args, prompts, reward, token_ids_tokenizer
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    results, tensors = runs
    train = results["train"][0]
    assert "error" not in train, train.get("traceback", train.get("error"))
    model = AutoModelForCausalLM.from_pretrained(train["model_directory"], dtype=torch.float64)
    model.train()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=grpo_args(str(train["model_directory"]) + "_one", **tensors["config"]),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts()]), processing_class=token_ids_tokenizer(),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # what train() sets
    return trainer


def load(model, weights: dict) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    model.zero_grad(set_to_none=True)


def per_token_logps(trainer, inputs: dict) -> torch.Tensor:
    from trl import GRPOTrainer

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, inputs["completion_ids"].shape[1]
        )
    return logps


def replay(trainer, inputs: dict, loss_type: str = "dapo") -> tuple[float, dict]:
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def worst(actual: dict, expected: dict) -> tuple[float, str]:
    assert actual.keys() == expected.keys()
    return max((relative(actual[name], expected[name]), name) for name in expected)


def test_grpo_steps_across_the_sp_group_match_one_process(runs, one_process):
    """Two steps (num_iterations=2: the second reuses the completions, with the old log-probs of the
    first weights), beta > 0: the log-probs of the policy, of the old policy and of the reference
    model, each step's loss (the same on both ranks) and the gradients after DDP's average equal TRL
    on one process on the same completions at the same weights."""
    results, tensors = runs
    ranks = results["train"]
    assert [r["losses"] for r in ranks] == [ranks[0]["losses"]] * NPROC
    assert [r["grad_checksums"] for r in ranks] == [ranks[0]["grad_checksums"]] * NPROC
    calls, grads = tensors["calls"], tensors["grads"]
    assert len(calls) == len(grads) == 2
    # What the slices must get right is there: left-padded prompts, completions of different lengths
    # (right padding), rows whose length the SP size does not divide.
    first = calls[0]["inputs"]
    assert (first["prompt_mask"] == 0).any() and (first["completion_mask"] == 0).any()
    assert (first["prompt_ids"].shape[1] + first["completion_ids"].shape[1]) % NPROC
    trainer = one_process
    load(trainer.model, tensors["initial"])
    reference_logps = per_token_logps(trainer, calls[0]["inputs"])  # the reference model = the initial weights
    for step, (call, stepped) in enumerate(zip(calls, grads, strict=True)):
        inputs = dict(call["inputs"])
        assert torch.equal(inputs["completion_ids"], calls[0]["inputs"]["completion_ids"])  # reused
        assert relative(inputs["ref_per_token_logps"], reference_logps) < LOGPS
        # The old log-probs: the policy at generation, i.e. before the first step.
        assert relative(inputs["old_per_token_logps"], reference_logps) < LOGPS
        load(trainer.model, call["weights"])
        assert relative(call["logps"], per_token_logps(trainer, inputs)) < LOGPS, f"step {step}"
        inputs["ref_per_token_logps"] = inputs["old_per_token_logps"] = reference_logps
        loss, expected = replay(trainer, inputs)
        assert abs(float(call["loss"]) - float(loss)) <= LOSS * max(abs(float(loss)), 1e-3), (step, call["loss"], loss)
        off, name = worst(stepped, expected)
        assert off < GRAD, f"step {step}: {name} off by {off:.2e}"
    assert float(calls[1]["loss"]) != 0.0  # the second iteration moved off the old policy


def loss_types() -> list[str]:
    from grpo_ulysses_worker import loss_types_of
    from trl import GRPOConfig

    return loss_types_of(GRPOConfig)


def test_the_loss_types_are_read_from_trl():
    assert {"grpo", "dapo", "dr_grpo", "bnpo"} <= set(loss_types())


@pytest.mark.parametrize("loss_type", loss_types())
def test_every_loss_type_matches_one_process(runs, one_process, loss_type):
    """TRL's compute_loss with each loss type GRPOConfig lists (per sequence, per token, DAPO's
    global count, Dr. GRPO's constant, ...), on the last step's inputs at the trained weights."""
    results, tensors = runs
    assert results["train"][0]["loss_types"] == results["train"][1]["loss_types"]
    actual = tensors["loss_types"][loss_type]
    load(one_process.model, tensors["trained"])
    loss, expected = replay(one_process, tensors["calls"][-1]["inputs"], loss_type)
    assert abs(float(actual["loss"]) - float(loss)) <= LOSS * max(abs(float(loss)), 1e-3), (actual["loss"], loss)
    off, name = worst(actual["grads"], expected)
    assert off < GRAD, f"{name} off by {off:.2e}"


def test_a_rank_feeding_another_ranks_slice_is_caught(runs, one_process):
    """Companion: each rank feeding the next rank's slice of every sequence (the gathered log-probs
    then belong to a shuffled sequence): the loss and the gradients move."""
    _, tensors = runs
    load(one_process.model, tensors["trained"])
    loss, expected = replay(one_process, tensors["calls"][-1]["inputs"])
    wrong = tensors["other_slice"]
    assert abs(float(wrong["loss"]) - float(loss)) > 1e-4 * abs(float(loss))
    assert worst(wrong["grads"], expected)[0] > 1e-2


def test_gradients_averaged_over_the_group_are_caught(runs, one_process):
    """Companion: without the group's sum (each rank's slice unscaled, DDP's average left as it is),
    every gradient is 1/sp of one process's, while the loss is right."""
    _, tensors = runs
    load(one_process.model, tensors["trained"])
    loss, expected = replay(one_process, tensors["calls"][-1]["inputs"])
    averaged = tensors["averaged"]
    assert abs(float(averaged["loss"]) - float(loss)) <= LOSS * abs(float(loss))
    for name, grad in expected.items():
        assert relative(averaged["grads"][name] * NPROC, grad) < GRAD, name
    assert worst(averaged["grads"], expected)[0] == pytest.approx(1 - 1 / NPROC, rel=1e-5)


def test_a_rank_holding_other_completions_is_refused(runs):
    """Rank 1's first completion differs by one token: every rank of the group refuses to score, by
    name, instead of splitting two different sequences as one."""
    results, _ = runs
    for result in results["train"]:
        error = result["other_completions_error"]
        assert error is not None and "do not hold the same sequences (SP rank(s) [1]" in error, error


def test_what_the_trainer_refuses(runs):
    results, _ = runs
    for result in results["refusals"]:
        assert "error" not in result, result.get("traceback", result.get("error"))
        errors = result["errors"]
        assert errors["unregistered"].startswith("RuntimeError") and "call register_ulysses" in errors["unregistered"]
        assert "micro_batch_size=4)" in errors["rows"], errors["rows"]
        assert "evaluation (eval_dataset / eval_strategy" in errors["evaluation"], errors["evaluation"]


def test_the_docs_recipe_runs_as_written(runs):
    """docs/trl.md's "GRPO across GPUs with Ulysses" script, as written there, on 2 CPU ranks: it
    trains its one prompt once per epoch (one step each: 4 generations, the group's batch) with
    UlyssesGRPOTrainer, both ranks logging the same training loss."""
    results, _ = runs
    ranks = results["docs_recipe"]
    for result in ranks:
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["trainer"] == "UlyssesGRPOTrainer" and result["steps"] == result["epochs"] > 0
        assert len(result["train_loss"]) == 1
    assert ranks[0]["train_loss"] == ranks[1]["train_loss"]
