"""TRL: SFTTrainer and DPOTrainer on a model whose offloading we enabled (TRL's own
`activation_offloading` flag off) log exactly what the same run without offloading logs; what
happens when both offloadings are on; and the TRL example runs.

No downloads: the tokenizer is a word-level one built here over a fixed vocabulary, the model a
tiny random Llama, the datasets come from datasets.Dataset.from_dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import enable_sim, quiet_training_args, run_example, tiny_model, twin
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

import hf_offload

LAYERS = 3  # tiny_model's num_hidden_layers
STEPS = 3
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]
WORDS = "the a cat dog bird sat ran flew on under over mat log tree red blue big small quickly slowly".split()  # noqa: SIM905
ROLES = ["user", "assistant", ":"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
# Keys of a log entry that measure time, not the computation.
TIMING = ("runtime", "per_second")


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL + ROLES + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        chat_template=CHAT_TEMPLATE,
    )


TOKENIZER = word_tokenizer()


def sentences(count: int, seed: int, lengths: tuple[int, int] = (4, 12)) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(count):
        length = int(torch.randint(*lengths, (1,), generator=generator))
        result.append(" ".join(WORDS[i] for i in torch.randint(len(WORDS), (length,), generator=generator)))
    return result


def lm_model() -> torch.nn.Module:
    return tiny_model(
        vocab_size=len(TOKENIZER),
        pad_token_id=TOKENIZER.pad_token_id,
        bos_token_id=TOKENIZER.bos_token_id,
        eos_token_id=TOKENIZER.eos_token_id,
    )


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")


def common_args(output_dir: Path) -> dict:
    return quiet_training_args(
        output_dir,
        max_steps=STEPS,
        max_length=32,
        activation_offloading=False,  # TRL's own; ours is enabled on the model
    )


def logged(trainer) -> list[dict]:
    """The log history without the timing entries, which differ from run to run."""
    return [
        {key: value for key, value in entry.items() if not any(word in key for word in TIMING)}
        for entry in trainer.state.log_history
    ]


def assert_same_trainable_weights(plain: torch.nn.Module, offloaded: torch.nn.Module) -> None:
    pairs = list(zip(plain.named_parameters(), offloaded.named_parameters(), strict=True))
    assert any(p.requires_grad for (_, p), _ in pairs)
    for (name, p), (_, q) in pairs:
        assert torch.equal(p, q), name


def sft_dataset(conversational: bool) -> Dataset:
    if conversational:
        prompts, answers = sentences(8, 1), sentences(8, 2)
        conversations = [
            [{"role": "user", "content": p}, {"role": "assistant", "content": a}]
            for p, a in zip(prompts, answers, strict=True)
        ]
        return Dataset.from_dict({"messages": conversations})
    return Dataset.from_dict({"text": sentences(8, 1)})


def run_sft(model, output_dir, *, peft_config=None, conversational=False, **overrides):
    args = SFTConfig(**{**common_args(output_dir), **overrides})
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=sft_dataset(conversational),
        processing_class=TOKENIZER,
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_sft_trainer_logs_identical_losses(tmp_path, tuning, checkpointing):
    """SFTTrainer, full fine-tuning on plain text or LoRA (peft_config, so TRL calls get_peft_model
    on the offloaded model) on a conversational dataset through a chat template; with and without
    TRL's default gradient checkpointing. Every logged value (loss, grad_norm, entropy, token
    accuracy, ...) and the trained weights equal those of the run without offloading."""
    base = lm_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    options = dict(peft_config=lora_config() if tuning == "lora" else None, conversational=tuning == "lora")
    torch.manual_seed(3)
    expected = run_sft(plain, tmp_path / "plain", activation_checkpointing=checkpointing, **options)
    torch.manual_seed(3)
    trainer = run_sft(offloaded, tmp_path / "offloaded", activation_checkpointing=checkpointing, **options)
    assert len([entry for entry in logged(trainer) if "loss" in entry]) == STEPS
    assert logged(trainer) == logged(expected)
    assert_same_trainable_weights(expected.model, trainer.model)

    assert trainer.model.is_activation_offloading
    stats = hf_offload.activation_offloading_stats(trainer.model)
    assert stats.total_layer_scopes == STEPS * LAYERS
    assert stats.layers_offloaded == LAYERS - 1
    assert stats.offloaded_tensors > 0
    if checkpointing:  # offloaded checkpointing: only the checkpointed layers' inputs move
        # With LoRA the first layer's input is the frozen embeddings' output, made to require grad
        # (a leaf of the graph): layer 0 takes it detoured, so it is offloaded like the others.
        assert stats.kept_tensors["leaf"] == 0
        assert stats.offloaded_tensors == LAYERS - 1
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


def dpo_dataset() -> Dataset:
    # Completions start with a space, so that the prompt's tokens are a prefix of prompt+completion.
    return Dataset.from_dict(
        {
            "prompt": sentences(8, 2, (3, 6)),
            "chosen": [" " + s for s in sentences(8, 3)],
            "rejected": [" " + s for s in sentences(8, 4)],
        }
    )


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_dpo_trainer_logs_identical_losses(tmp_path, tuning):
    """DPOTrainer: each step runs the policy forward (chosen and rejected concatenated), then the
    reference forward under no_grad before the one backward: a separate reference model (full;
    here a deep copy of the offloaded policy, which gets an offloader of its own) or the same model
    with its adapter disabled (LoRA). Every logged value (loss, rewards, log-probs, ...) and the
    trained weights equal those of the run without offloading, and the reference forwards did no
    offloading work."""
    base = lm_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    trainers = {}
    for name, model in (("plain", plain), ("offloaded", offloaded)):
        ref_model = twin(model) if tuning == "full" else None
        args = DPOConfig(**common_args(tmp_path / name), activation_checkpointing=False)
        torch.manual_seed(3)
        trainers[name] = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=dpo_dataset(),
            processing_class=TOKENIZER,
            peft_config=lora_config() if tuning == "lora" else None,
        )
        trainers[name].train()
    expected, trainer = trainers["plain"], trainers["offloaded"]
    assert len([entry for entry in logged(trainer) if "loss" in entry]) == STEPS
    assert logged(trainer) == logged(expected)
    assert_same_trainable_weights(expected.model, trainer.model)

    stats = hf_offload.activation_offloading_stats(trainer.model)
    assert stats.total_layer_scopes == STEPS * LAYERS, "a reference forward did offloading work"
    assert stats.layers_offloaded == LAYERS - 1
    assert stats.offloaded_tensors > 0
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0
    if tuning == "full":
        assert trainer.ref_model.is_activation_offloading
        assert hf_offload.activation_offloading_stats(trainer.ref_model).total_layer_scopes == 0


def cpu_capable_trl_offloading(monkeypatch) -> list:
    """Let SFTTrainer build TRL's own offloading on a CPU-only machine, where it raises: it reads
    torch.accelerator.current_accelerator().type (None here), pins host memory and synchronizes
    streams, none of which exists without an accelerator, and at every step, once bitsandbytes is
    imported (PEFT imports it when it is installed), empties the device's cache (`torch.cpu` has no
    `empty_cache`). With the CPU taken as the accelerator, no pinning, no streams and no cache to
    empty, TRL's real hooks run on CPU tensors (like our simulate_on_cpu)."""
    import trl.trainer.sft_trainer as sft_trainer
    from trl.models import activation_offloading

    real = activation_offloading.get_act_offloading_ctx_manager
    created = []

    def on_cpu(model, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kw: torch.device("cpu"))
            context = real(model, use_pin_memory=False, use_streams=False, **kwargs)
        created.append(context)
        return context

    monkeypatch.setattr(sft_trainer, "get_act_offloading_ctx_manager", on_cpu)
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)
    return created


def test_both_offloadings_on_stay_exact(tmp_path, monkeypatch):
    """SFTConfig(activation_offloading=True) on a model with our offloading enabled: TRL's
    saved-tensor hooks surround the whole training step and ours, entered inside each decoder
    layer, take precedence there. So ours moves the decoder layers' tensors and TRL's the rest
    (embeddings, final norm, loss): wasteful, not wrong. The losses equal the run without any
    offloading."""
    created = cpu_capable_trl_offloading(monkeypatch)
    base = lm_model()
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    expected = run_sft(plain, tmp_path / "plain", activation_checkpointing=False)
    trainer = run_sft(offloaded, tmp_path / "both", activation_checkpointing=False, activation_offloading=True)
    assert logged(trainer) == logged(expected)
    assert_same_trainable_weights(expected.model, trainer.model)
    assert len(created) == 1 and created[0].tensor_id > 0, "TRL's offloading did not run"
    assert hf_offload.activation_offloading_stats(offloaded).offloaded_tensors > 0


def test_both_offloadings_on_warn_with_what_to_do(tmp_path, monkeypatch, caplog):
    """Both on is a configuration mistake: one warning from hf_offload naming TRL's
    activation_offloading and what to do (turn it off: hf_offload already offloads the layers)."""
    cpu_capable_trl_offloading(monkeypatch)
    model = lm_model()
    enable_sim(model)
    with caplog.at_level("WARNING", logger="hf_offload"):
        run_sft(model, tmp_path, activation_checkpointing=False, activation_offloading=True)
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "hf_offload" and "activation_offloading" in r.getMessage()
    ]
    assert len(warnings) == 1, "one warning per model, not one per step"
    assert "activation_offloading=False" in warnings[0]


def test_trl_sft_example_runs():
    result = run_example("trl_sft.py", "--steps", "2", "--compare")
    assert result.returncode == 0, result.stderr
    assert "losses with offloading:" in result.stdout
    assert "deterministic kernels: none needed on cpu" in result.stdout
    assert "identical to the run without offloading: yes" in result.stdout
    assert "offloaded:" in result.stdout


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_sft_trainer_with_sequence_tiling_logs_the_untiled_run(tmp_path, tuning):
    """SFTTrainer on a tiled model (slices of 4 tokens, offloading on too): TRL's own fused LM head
    computes the loss and its metrics from the final hidden states, the layers' per-token parts
    run tiled; every logged value is close to the untiled run's (under TRL's default bf16
    autocast, where a slice's matmuls round differently from the whole sequence's)."""
    base = lm_model()
    plain, tiled = base, twin(base)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=4)
    enable_sim(tiled)
    options = dict(peft_config=lora_config() if tuning == "lora" else None, conversational=tuning == "lora")
    torch.manual_seed(3)
    expected = run_sft(plain, tmp_path / "plain", **options)
    torch.manual_seed(3)
    trainer = run_sft(tiled, tmp_path / "tiled", **options)
    assert trainer.model.is_sequence_tiling
    actual, reference = logged(trainer), logged(expected)
    assert [sorted(entry) for entry in actual] == [sorted(entry) for entry in reference]
    # Token accuracy counts top-1 hits: a random tiny model's logits are near ties, and one of them may
    # fall the other way under bf16 rounding (measured: one token of 42 in a step, on two busy threads).
    one_token = 1 / min(int((b["labels"][:, 1:] != -100).sum()) for b in trainer.get_train_dataloader())
    for mine, theirs in zip(actual, reference, strict=True):
        for key, value in theirs.items():
            if key == "mean_token_accuracy":
                assert abs(mine[key] - value) <= one_token * 1.001, key
            else:
                assert mine[key] == pytest.approx(value, rel=1e-2), key
