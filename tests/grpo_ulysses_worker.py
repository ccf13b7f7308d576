"""Run by tests/test_grpo_ulysses.py under `python -m torch.distributed.run --standalone
--nproc-per-node N` with DS_ACCELERATOR=cpu: UlyssesGRPOTrainer on N CPU ranks (gloo), one SP group
of N (one data-parallel process), DDP, a tiny float64 Llama with hf_offload's offloading, sequence
tiling and checkpointing.

What each rank saw is written for the test, which replays TRL's own GRPOTrainer on one process on
the same completions at the same weights (rank 0 saves the tensors: every scored batch, the
weights before it, the loss, the per-token log-probs and the gradients the optimizer stepped with).

GRPO_ULYSSES_SP=2 with 4 ranks makes two SP groups of 2 (each group's rank 0 saves its tensors:
tensors.pt, tensors_1.pt); tests/test_grpo_ulysses.py's checks are for one group.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import VOCAB, enable_sim, quiet_training_args, tiny_model  # noqa: E402
from workers import run_scenarios, write_results_and_tear_down  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload.integrations import grpo_ulysses  # noqa: E402
from hf_offload.integrations import sequence_parallel as sp  # noqa: E402

ROWS = 4  # per_device_train_batch_size: 2 prompts x 2 generations per group
GENERATIONS = 2
COMPLETION = 8
TILE = 4
LR = 0.05
OUT = ""
SP = 0  # the SP size: GRPO_ULYSSES_SP, else the world size (one group)


def token_ids_tokenizer():
    """Words are the token ids themselves ("0" .. "96"), pad "0", eos "1"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={str(i): i for i in range(VOCAB)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="0", unk_token="0", eos_token="1")


def prompts() -> list[str]:
    """Prompts of 2 to 9 tokens, each length once: left padding in every batch."""
    generator = torch.Generator().manual_seed(950)
    lengths = [3, 6, 4, 9, 2, 8, 5, 7]
    return [" ".join(str(int(i)) for i in torch.randint(20, VOCAB, (n,), generator=generator)) for n in lengths]


def reward(completions, **kwargs):
    return [float(sum(int(word) % 7 for word in text.split() if word.isdigit())) for text in completions]


def grpo_args(out: str, **overrides):
    from trl import GRPOConfig

    settings = dict(
        max_steps=2, per_device_train_batch_size=ROWS, learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=0.0, weight_decay=0.0, optim="sgd", seed=7,
    )  # fmt: skip
    settings.update(overrides.pop("training", {}))
    return GRPOConfig(
        **quiet_training_args(out, **settings), bf16=False, num_generations=GENERATIONS,
        max_completion_length=COMPLETION, gradient_checkpointing=True, model_init_kwargs={"dtype": torch.float64},
        # Sampled among tokens 1 (eos) to 4 only: completions end early, of different lengths (right padding).
        generation_kwargs={"suppress_tokens": [0, *range(5, VOCAB)]},
        **overrides,
    )  # fmt: skip


def model_directory() -> str:
    """The tiny Llama saved once (TRL builds the reference model from the policy's path)."""
    path = os.path.join(os.path.dirname(OUT), "model")
    if dist.get_rank() == 0:
        tiny_model("llama", seed=0, use_cache=False, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1).save_pretrained(
            path
        )
    dist.barrier()
    return path


def fresh_state() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    sp.unregister_ulysses()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def policy(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model.train()
    enable_sim(model)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    return model


def detached(inputs: dict) -> dict:
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}


def weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def build_trainer(path: str, out: str, record: dict, **config):
    from datasets import Dataset
    from transformers import TrainerCallback

    model = policy(path)
    sp.register_ulysses(model, SP, micro_batch_size=ROWS)
    base = grpo_ulysses.UlyssesGRPOTrainer

    class Recording(base):
        def compute_loss(self, model, inputs, *rest, **kwargs):
            before = weights(self.model)
            loss = super().compute_loss(model, inputs, *rest, **kwargs)
            record["calls"].append({"inputs": detached(inputs), "weights": before, "loss": loss.detach().clone(),
                                    "logps": record.pop("last_logps", None)})  # fmt: skip
            return loss

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if torch.is_grad_enabled():
                record["last_logps"] = result[0].detach().clone()
            return result

    class Gradients(TrainerCallback):  # what the optimizer steps with (after DDP's average over the ranks)
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    trainer = Recording(
        model=model, reward_funcs=reward, args=grpo_args(out, **config),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts()]),
        processing_class=token_ids_tokenizer(), callbacks=[Gradients()],
    )  # fmt: skip
    return trainer, model


def scenario_train(**config) -> dict:
    """Two steps of UlyssesGRPOTrainer.train(), then TRL's compute_loss for every loss type on the
    last step's inputs (and the companions: a rank feeding another rank's slice, the gradients
    averaged over the group, a rank holding other completions)."""
    fresh_state()
    path = model_directory()
    out = os.path.join(os.path.dirname(OUT), "train")
    record = {"calls": [], "grads": []}
    trainer, model = build_trainer(path, out, record, **config)
    initial = weights(model)
    trainer.train()
    result = {"losses": [float(call["loss"]) for call in record["calls"]], "steps": len(record["grads"])}
    result["grad_checksums"] = [float(sum(g.double().abs().sum() for g in step.values())) for step in record["grads"]]
    tensors = {"initial": initial, "calls": list(record["calls"]), "grads": list(record["grads"]), "config": config}

    # Every loss type on the last scored inputs, at the trained weights.
    from trl import GRPOConfig

    inputs = record["calls"][-1]["inputs"]
    trained = weights(model)
    model.train()

    def replay(loss_type: str) -> dict:
        trainer.loss_type = loss_type
        trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model_wrapped, dict(inputs))
        loss.backward()  # through DDP: averaged over the ranks
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return {"loss": loss.detach().clone(), "grads": grads}

    loss_types = loss_types_of(GRPOConfig)
    tensors["trained"] = trained
    tensors["loss_types"] = {name: replay(name) for name in loss_types}
    result["loss_types"] = {name: float(value["loss"]) for name, value in tensors["loss_types"].items()}

    # Companions.
    original = grpo_ulysses._shard_rank
    grpo_ulysses._shard_rank = lambda ulysses: (ulysses.rank + 1) % ulysses.size
    try:
        tensors["other_slice"] = replay("dapo")
    finally:
        grpo_ulysses._shard_rank = original
    original = grpo_ulysses.sums_over_sequence_parallel_ranks
    grpo_ulysses.sums_over_sequence_parallel_ranks = lambda model: True  # no scaling: DDP's average stays an average
    try:
        tensors["averaged"] = replay("dapo")
    finally:
        grpo_ulysses.sums_over_sequence_parallel_ranks = original
    other = dict(inputs)
    if dist.get_rank() % SP == 1:  # SP rank 1 of every group (DDP's forward is a collective of all ranks)
        other["completion_ids"] = other["completion_ids"].clone()
        other["completion_ids"][0, 0] = (other["completion_ids"][0, 0] + 1) % VOCAB
    try:
        trainer.compute_loss(trainer.model_wrapped, other)
        result["other_completions_error"] = None
    except ValueError as error:
        result["other_completions_error"] = str(error)
    trainer.loss_type = "dapo"
    if dist.get_rank() % SP == 0:  # each group's rank 0: tensors.pt (group 0), tensors_1.pt, ...
        group = dist.get_rank() // SP
        torch.save(tensors, os.path.join(os.path.dirname(OUT), f"tensors{f'_{group}' if group else ''}.pt"))
    result["model_directory"] = path
    sp.unregister_ulysses()
    return result


def loss_types_of(config_class) -> list[str]:
    """The loss types GRPOConfig's own help lists ("Supported values are 'grpo', 'dr_grpo', ...")."""
    import dataclasses
    import re

    field = next(f for f in dataclasses.fields(config_class) if f.name == "loss_type")
    text = field.metadata["help"]
    listed = text[text.index("Supported values are") :].split(". ")[0]
    return re.findall(r"'([a-z_]+)'", listed)


def scenario_refusals() -> dict:
    """What the trainer refuses by name: no registration, a registration for other rows, evaluation."""
    from datasets import Dataset

    fresh_state()
    path = model_directory()
    out = os.path.join(os.path.dirname(OUT), "refusals")
    errors = {}
    dataset = Dataset.from_list([{"prompt": p} for p in prompts()])

    def attempt(name, register_rows=None, trainer=None, **config):
        fresh_state()
        model = policy(path)
        if register_rows is not None:
            sp.register_ulysses(model, SP, micro_batch_size=register_rows)
        try:
            grpo_ulysses.UlyssesGRPOTrainer(model=model, reward_funcs=reward, args=grpo_args(out, **config),
                                            train_dataset=dataset, processing_class=token_ids_tokenizer(),
                                            **(trainer or {}))  # fmt: skip
            errors[name] = None
        except (ValueError, RuntimeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"

    attempt("unregistered")
    attempt("rows", register_rows=2)
    attempt("evaluation", register_rows=ROWS, trainer={"eval_dataset": dataset})
    sp.unregister_ulysses()
    return {"errors": errors}


def recipe() -> str:
    """The python block after "### GRPO across GPUs with Ulysses" in docs/trl.md, as written there."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "trl.md")) as doc:
        text = doc.read()
    after = text[text.index("\n### GRPO across GPUs with Ulysses\n") :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```", start)]


def scenario_docs_recipe() -> dict:
    """The recipe of docs/trl.md run as written (its deepspeed.init_distributed finds the process group
    up) on the tiny Llama and its tokenizer saved to a directory: 1 prompt, one step per epoch."""
    fresh_state()
    out = os.path.dirname(OUT)
    path = os.path.join(out, "recipe_model")
    if dist.get_rank() == 0:
        tiny_model("llama", seed=0, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1).save_pretrained(path)
        token_ids_tokenizer().save_pretrained(path)
    dist.barrier()
    from datasets import Dataset

    namespace = {"path": path, "dataset": Dataset.from_list([{"prompt": p} for p in prompts()[:1]]),
                 "reward": reward, "completion_length": COMPLETION}  # fmt: skip
    cwd = os.getcwd()
    os.chdir(out)  # where the recipe's output directory goes
    try:
        exec(compile(recipe(), "docs/trl.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    trainer = namespace["trainer"]
    losses = [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry]
    return {"steps": trainer.state.global_step, "epochs": trainer.args.num_train_epochs, "train_loss": losses,
            "trainer": type(trainer).__name__}  # fmt: skip


SCENARIOS = {
    "train": lambda: scenario_train(beta=0.1, num_iterations=2, loss_type="dapo", scale_rewards="batch"),
    "refusals": scenario_refusals,
    "docs_recipe": scenario_docs_recipe,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    global OUT, SP
    OUT = os.path.abspath(args.out)

    import deepspeed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    SP = int(os.environ.get("GRPO_ULYSSES_SP", "0")) or dist.get_world_size()
    results = run_scenarios(SCENARIOS, args.scenarios, after_each=sp.unregister_ulysses)
    write_results_and_tear_down(args.out, results)


if __name__ == "__main__":
    main()
