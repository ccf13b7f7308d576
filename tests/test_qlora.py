"""QLoRA on the CPU: bitsandbytes 4-bit bases (and 8-bit ones), loaded as users load them, with
`from_pretrained(path, quantization_config=BitsAndBytesConfig(...))` of a tiny random Llama saved
here (bitsandbytes 0.47+ quantizes and runs 4-bit layers on the CPU, forward and backward).

Under offloading they train bit for bit as without it, the packed 4-bit weights never moved; tiled,
close to untiled with the gradient of the loss reported; through the disk tier, bit for bit; with
the Trainer's default arguments and TRL's SFTTrainer, as without offloading. bitsandbytes' CPU
inference repack (see `docs/peft.md`) is tested with the CPU flag it reads forced both ways, so that
no test here depends on the machine it runs on."""

from __future__ import annotations

import os
from pathlib import Path

import bitsandbytes.nn.modules as bnb_modules
import pytest
import torch
from bitsandbytes.nn import Linear4bit, Linear8bitLt
from conftest import (
    BATCH,
    SEQ,
    RandomTokens,
    assert_bit_identical,
    assert_same_step,
    batch,
    directional_derivatives,
    enable_sim,
    tiny_model,
    train_step,
    twin,
)
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from routing import assert_parity_and_routing
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

import hf_offload
from hf_offload.tiling import per_token
from hf_offload.tools.allocations import one_thread

# prepare_model_for_kbit_training's default checkpointing leaves use_reentrant unset, which torch warns about.
pytestmark = pytest.mark.filterwarnings("ignore:.*use_reentrant parameter should be passed explicitly:UserWarning")

LAYERS = 3  # tiny_model's
# bitsandbytes' CPU inference repack (below) reshapes the statistics per 64-value block of a row
# and packs 32 rows at a time: in_features must be a multiple of 64 and out_features of 32 (with
# hidden_size 32 an eval forward fails on an AVX512-BF16 CPU with "shape '[32, 0]' is invalid").
SHAPES = dict(hidden_size=64, intermediate_size=128, head_dim=16)
HIDDEN = SHAPES["hidden_size"]
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down: every one is 4-bit (lm_head stays as loaded)
TILE, TILED_SEQ = 16, 64

# prepare_model_for_kbit_training's checkpointing: its default (use_reentrant unset: torch's
# reentrant checkpoint, with the embeddings' output made to require grad), non-reentrant, none.
PREPARE = {
    "default": {},
    "non_reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
    "none": {"use_gradient_checkpointing": False},
}


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny models' ops, bitsandbytes' among them, run many times faster on one intra-op thread
    # than on two when the machine is busy (this file, 2026-12-02, load average 4-5 on 2 cores:
    # 236 s on two threads, 10 s on one).
    with one_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model(**SHAPES).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deeper_checkpoint(tmp_path_factory) -> Path:
    """Six layers (five offloaded): room for layers in host memory, layers on disk, and the disk
    tier's staging buffers (two layers' copies) within one host budget."""
    path = tmp_path_factory.mktemp("tiny-llama-6")
    tiny_model(**SHAPES, num_hidden_layers=6).save_pretrained(path)
    return path


def load(path: Path, bits: int = 4, quant_type="nf4", double_quant=False, compute_dtype=torch.float32):
    """The model as a user loads it (in train mode: from_pretrained returns it in eval mode), its
    4-bit layers told the CPU has no AVX512-BF16 whatever it has, so that no test depends on the
    machine (bitsandbytes' inference repack is tested on its own below, the flag forced both ways)."""
    if bits == 4:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    else:
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, dtype=compute_dtype, device_map="cpu"
    )
    kind = Linear4bit if bits == 4 else Linear8bitLt
    quantized = [module for module in model.modules() if isinstance(module, kind)]
    assert len(quantized) == LINEARS_PER_LAYER * model.config.num_hidden_layers
    if bits == 4:
        for module in quantized:
            module.support_avx512bf16_for_cpu = False
    return model.train()


def adapt(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    # init_lora_weights=False gives B a random start, so every adapter gradient is non-zero.
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def qlora(path: Path, checkpointing: str = "default", **quantization) -> torch.nn.Module:
    """The usual QLoRA recipe: load in 4 bits, prepare_model_for_kbit_training, LoRA."""
    return adapt(prepare_model_for_kbit_training(load(path, **quantization), **PREPARE[checkpointing]))


def ids(seed: int = 1, seq: int = TILED_SEQ) -> torch.Tensor:
    return batch(seed=seed, seq=seq)


def four_bit_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: module.weight for name, module in model.named_modules() if isinstance(module, Linear4bit)}


# -- offloading --------------------------------------------------------------------------------------

# (checkpointing, quant_type, double_quant, compute_dtype). The full product is 3 x 2 x 2 x 2 = 24
# runs. These 6 hold every pair of values of any two factors (each checkpointing with each value of
# the others; NF4 and FP4 each with and without double quantization and with both compute dtypes,
# and so on): each factor changes one thing the engine could meet (what is saved and where the
# checkpoint is; the 4-bit code; the statistics' storage; the dtype the layers compute in and so
# the casts LoRA saves), and an interaction of two of them shows in some row.
VARIANTS = [
    ("default", "nf4", True, torch.float32),
    ("default", "fp4", False, torch.bfloat16),
    ("non_reentrant", "nf4", False, torch.bfloat16),
    ("non_reentrant", "fp4", True, torch.float32),
    ("none", "nf4", True, torch.bfloat16),
    ("none", "fp4", False, torch.float32),
]


@pytest.mark.parametrize(
    "checkpointing, quant_type, double_quant, compute_dtype",
    VARIANTS,
    ids=[f"{c}-{q}-{'dq' if d else 'no_dq'}-{str(t).split('.')[-1]}" for c, q, d, t in VARIANTS],
)
def test_offloading_a_qlora_model_is_bit_identical(
    checkpoint, checkpointing, quant_type, double_quant, compute_dtype, monkeypatch
):
    """Offloading enabled on the loaded 4-bit model, then prepare_model_for_kbit_training (which
    replaces the storage of every parameter it upcasts) and LoRA: two steps with identical losses
    and gradients, exactly the non-parameter storages the layers saved offloaded, and no packed
    4-bit weight or its statistics ever copied."""
    base = load(checkpoint, quant_type=quant_type, double_quant=double_quant, compute_dtype=compute_dtype)
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    plain, offloaded = (adapt(prepare_model_for_kbit_training(m, **PREPARE[checkpointing])) for m in (plain, offloaded))
    weights = four_bit_weights(offloaded)
    state = next(iter(weights.values())).quant_state
    assert (state.quant_type, state.nested) == (quant_type, double_quant)
    assert all(w.dtype == torch.uint8 and not w.requires_grad for w in weights.values())

    stats = assert_parity_and_routing(plain, offloaded, monkeypatch)
    if checkpointing == "none":
        assert stats.kept_tensors["parameter"] > 0  # LoRA's weight.t() views
    else:  # the checkpointed layers' inputs, float32 after prepare (layer 0's too: see test_peft_variants)
        assert (stats.offloaded_tensors, stats.offloaded_bytes) == (LAYERS - 1, (LAYERS - 1) * BATCH * SEQ * HIDDEN * 4)
    for name, weight in four_bit_weights(offloaded).items():  # still the packed weights, unchanged
        assert torch.equal(weight, weights[name]) and weight.dtype == torch.uint8, name


@pytest.mark.parametrize("checkpointing", ["none", "non_reentrant"])
def test_offloading_an_8bit_model_is_bit_identical(checkpoint, checkpointing, monkeypatch):
    """load_in_8bit works exactly under offloading. (On the CPU bitsandbytes' 8-bit layers keep
    their input as an attribute of the autograd context, not as a saved tensor: no saved-tensor
    hook sees it, so it is neither offloaded nor freed by checkpointing; docs/peft.md.)"""
    base = load(checkpoint, bits=8)
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    plain, offloaded = (adapt(prepare_model_for_kbit_training(m, **PREPARE[checkpointing])) for m in (plain, offloaded))
    stats = assert_parity_and_routing(plain, offloaded, monkeypatch)
    if checkpointing == "non_reentrant":
        assert (stats.offloaded_tensors, stats.offloaded_bytes) == (LAYERS - 1, (LAYERS - 1) * BATCH * SEQ * HIDDEN * 4)


# -- tiling, the disk tier ---------------------------------------------------------------------------


def test_tiling_a_qlora_model_is_close_and_its_gradient_is_that_of_the_reported_loss(checkpoint):
    """Tiled (the MLPs, norms, LoRA'd projections and the loss head slice by slice), a 4-bit model's
    step is close to the untiled one; the analytic directional derivative equals the finite
    difference of the loss it reports; offloading on top is bit-identical to tiling alone."""
    plain = qlora(checkpoint, "non_reentrant")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    inputs = ids()
    expected_loss, expected = train_step(plain, inputs)
    loss, actual = train_step(tiled, inputs)
    assert any(per_token.is_tiled(m) for m in tiled.modules())
    torch.testing.assert_close(loss, expected_loss, rtol=2e-3, atol=1e-5)
    assert actual.keys() == expected.keys() and actual
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=2e-3, atol=1e-5, msg=name)

    analytic, difference = directional_derivatives(tiled, {"input_ids": inputs, "labels": inputs})
    assert abs(analytic) > 1e-3
    assert analytic == pytest.approx(difference, rel=1e-2)

    both = twin(tiled)
    enable_sim(both)
    for seed in (1, 2):
        assert_same_step(tiled, both, ids(seed), f"(seed {seed})")
    assert both.activation_offloading_stats().offloaded_tensors > 0


def test_the_disk_tier_under_a_qlora_model_is_bit_identical(deeper_checkpoint, tmp_path):
    """A host budget of 70% of what full offloading takes: the earliest layers' activations go to
    disk and come back bit for bit; nothing is left in memory or on disk afterwards."""
    plain = qlora(deeper_checkpoint, "none")
    measure, model = twin(plain), twin(plain)
    enable_sim(measure)
    train_step(measure, batch())
    full = measure.activation_offloading_stats().pool_bytes
    enable_sim(model, disk_dir=tmp_path, max_host_bytes=int(full * 0.7))
    for seed in (1, 2):
        assert_same_step(plain, model, batch(seed=seed), f"(seed {seed})")
        stats = model.activation_offloading_stats()
        assert 0 < stats.disk_offloaded_tensors < stats.offloaded_tensors
    stats = model.activation_offloading_stats()
    assert (stats.host_bytes_held, stats.live_host_copies, stats.disk_bytes_held) == (0, 0, 0)
    assert os.listdir(tmp_path) == []


# -- the Trainer and TRL -----------------------------------------------------------------------------


def test_the_trainer_with_its_default_arguments_trains_a_qlora_model_as_without_offloading(checkpoint, tmp_path):
    """TrainingArguments(output_dir) and nothing else (3 epochs of one batch of 8 here), on the
    usual recipe: the same training loss and the same trained adapters."""
    runs = {}
    for name in ("plain", "offloaded"):
        model = qlora(checkpoint)
        if name == "offloaded":
            model.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
        trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / name)),
                          train_dataset=RandomTokens(8, 0))  # fmt: skip
        runs[name] = trainer, trainer.train()
    (expected, expected_result), (trainer, result) = runs["plain"], runs["offloaded"]
    assert result.global_step == expected_result.global_step == 3
    assert result.training_loss == expected_result.training_loss
    pairs = list(zip(expected.model.named_parameters(), trainer.model.named_parameters(), strict=True))
    assert any(p.requires_grad for (_, p), _ in pairs)
    for (name, p), (_, q) in pairs:
        assert torch.equal(p, q), name
    stats = trainer.model.activation_offloading_stats()
    assert stats.offloaded_tensors == LAYERS - 1  # the checkpointed layers' inputs (prepare's checkpointing)
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


def test_sft_trainer_with_peft_config_trains_a_4bit_model_as_without_offloading(tmp_path):
    """TRL's SFTTrainer given the 4-bit model and a LoraConfig (it applies LoRA itself and casts
    the adapters to bf16 for a quantized model), with its default checkpointing, on a
    conversational dataset: every logged value and the trained adapters as without offloading."""
    from test_trl import STEPS, TOKENIZER, assert_same_trainable_weights, logged, lora_config, run_sft

    path = tmp_path / "model"
    special = dict(pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.bos_token_id,
                   eos_token_id=TOKENIZER.eos_token_id)  # fmt: skip
    tiny_model(**SHAPES, vocab_size=len(TOKENIZER), **special).save_pretrained(path)
    trainers = {}
    for name in ("plain", "offloaded"):
        model = load(path)
        if name == "offloaded":
            enable_sim(model)
        torch.manual_seed(3)
        trainers[name] = run_sft(model, tmp_path / name, peft_config=lora_config(), conversational=True)
    expected, trainer = trainers["plain"], trainers["offloaded"]
    assert len([entry for entry in logged(trainer) if "loss" in entry]) == STEPS
    assert logged(trainer) == logged(expected)
    assert_same_trainable_weights(expected.model, trainer.model)
    adapters = [p for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.bfloat16 for p in adapters)
    assert all(w.dtype == torch.uint8 for w in four_bit_weights(trainer.model).values())
    stats = trainer.model.activation_offloading_stats()
    assert stats.offloaded_tensors == LAYERS - 1  # TRL's default checkpointing: the layers' inputs
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


# -- bitsandbytes' inference repack on the CPU -------------------------------------------------------


def record_inference_repacks(model: torch.nn.Module, monkeypatch, cpu_has_avx512_bf16: bool) -> list[str]:
    """Force the CPU flag that bitsandbytes' `Linear4bit.forward` reads (each layer's
    `support_avx512bf16_for_cpu`, set from the CPU when the layer was made), and record, by layer
    name, each repack of a weight into bitsandbytes' CPU inference layout that forward starts,
    without doing it: the weight keeps its layout and the step computes as it would without the
    repack, on any machine (the inference layout's kernel exists only on AVX512-BF16 CPUs)."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear4bit):
            assert hasattr(module, "support_avx512bf16_for_cpu"), "bitsandbytes no longer reads this flag"
            monkeypatch.setattr(module, "support_avx512bf16_for_cpu", cpu_has_avx512_bf16)
            names[id(module.weight.quant_state)] = name
    repacked: list[str] = []

    def record(weight, quant_state):
        repacked.append(names[id(quant_state)])
        return weight, quant_state

    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu", record)
    return repacked


def test_bitsandbytes_repacks_for_inference_on_an_eval_forward_without_grad(checkpoint, monkeypatch):
    """What bitsandbytes 0.50 does on an AVX512-BF16 CPU, and what the flag forced off (the
    workaround docs/peft.md gives) prevents: an eval-mode forward whose input needs no grad (an
    evaluation, generate) repacks every 4-bit weight for inference, for good; a training-mode
    forward never does."""
    model = qlora(checkpoint)
    inputs = batch()
    for cpu_has_avx512_bf16 in (True, False):
        with monkeypatch.context() as patch:
            repacked = record_inference_repacks(model, patch, cpu_has_avx512_bf16)
            for training in (True, False):
                model.train(training)
                with torch.no_grad():
                    model(input_ids=inputs)
                assert len(repacked) == (0 if training or not cpu_has_avx512_bf16 else LINEARS_PER_LAYER * LAYERS)
                repacked.clear()


def test_a_tiled_step_in_eval_mode_gives_bitsandbytes_no_forward_it_reads_as_inference(checkpoint, monkeypatch):
    """A forward and backward in eval mode (with prepare's checkpointing, which makes every layer's
    input require grad): tiling runs the modules whole, as checkpointing does in eval mode, so no
    4-bit layer sees a forward without grad, and the step is bit-identical to the untiled one."""
    plain = qlora(checkpoint)
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    for model in (plain, tiled):
        model.eval()
    repacked = record_inference_repacks(tiled, monkeypatch, cpu_has_avx512_bf16=True)
    expected_loss, expected = train_step(plain, ids())
    loss, actual = train_step(tiled, ids())
    assert repacked == []
    assert torch.equal(loss, expected_loss)
    assert_bit_identical(expected, actual)


def test_tiling_in_eval_mode_would_have_bitsandbytes_repack_the_4bit_weights(checkpoint, monkeypatch):
    """Companion: the same eval-mode step with the tiled MLPs put in training mode (so that they
    tile) while their 4-bit layers stay in eval mode: the slices tiling runs under no_grad in
    forward are forwards bitsandbytes reads as inference."""
    model = qlora(checkpoint)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    model.eval()
    mlps = [layer.mlp for layer in model.get_base_model().model.layers]
    assert all(per_token.is_tiled(mlp) for mlp in mlps)
    for mlp in mlps:
        mlp.training = True
    repacked = record_inference_repacks(model, monkeypatch, cpu_has_avx512_bf16=True)
    train_step(model, ids())
    assert {name.rsplit(".", 2)[-2] for name in repacked if ".mlp." in name} == {"gate_proj", "up_proj", "down_proj"}


# -- the recipe that keeps bf16 what needs no float32 -------------------------------------------------


def test_the_bf16_recipe_keeps_all_but_the_adapters_in_bf16_and_offloads_exactly(checkpoint, monkeypatch):
    """docs/peft.md's recipe: a bf16 4-bit load, activation_checkpointing_enable() instead of
    prepare_model_for_kbit_training, LoRA. The norms, embeddings and lm_head stay bf16 (prepare
    makes them float32), the adapters are float32 (PEFT's default), and the checkpointed layers'
    inputs, the residual stream, are bf16: half the bytes offloaded. Offloading is bit-identical."""
    base = load(checkpoint, double_quant=True, compute_dtype=torch.bfloat16)
    plain, offloaded = base, twin(base)
    enable_sim(offloaded)
    for model in (plain, offloaded):
        model.activation_checkpointing_enable()
    plain, offloaded = adapt(plain), adapt(offloaded)
    four_bit = {id(w) for w in four_bit_weights(offloaded).values()}
    dtypes = {
        name: p.dtype for name, p in offloaded.named_parameters() if id(p) not in four_bit and not p.requires_grad
    }
    assert any("embed_tokens" in n for n in dtypes) and any("lm_head" in n for n in dtypes)
    assert any("norm" in n for n in dtypes) and set(dtypes.values()) == {torch.bfloat16}
    adapters = [p for p in offloaded.parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)

    stats = assert_parity_and_routing(plain, offloaded, monkeypatch)
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (LAYERS - 1, (LAYERS - 1) * BATCH * SEQ * HIDDEN * 2)


def test_the_recipes_benchmark_counts_what_each_recipe_keeps(monkeypatch, capsys):
    """`python -m hf_offload.tools.benchmarks.qlora_recipes` (docs/peft.md's measured table) on a
    tiny Llama: the norms, embeddings and lm_head counted at 4 bytes a parameter under prepare and
    2 in the bf16 recipe, the same 4-bit weights and adapters in both, a peak for each step."""
    from hf_offload.tools.benchmarks import qlora_recipes

    vocab = 4096  # the embeddings and lm_head large enough to show in MiB to two decimals
    shapes = dict(qlora_recipes.SHAPES, **SHAPES, num_hidden_layers=2, num_attention_heads=4, vocab_size=vocab)
    monkeypatch.setattr(qlora_recipes, "SHAPES", shapes)
    qlora_recipes.main(["--seq-len", "64", "--tile-tokens", "16"])
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ")
    ]
    header, *rows = rows
    table = {row[0]: {name: float(cell) for name, cell in zip(header[1:], row[1:], strict=True)} for row in rows}
    assert set(table) == {"prepare", "bf16"}
    rest = 2 * vocab * HIDDEN + (2 * 2 + 1) * HIDDEN  # embeddings, lm_head, two norms a layer and the final one
    assert table["prepare"]["norms, embeddings, lm_head, MiB"] == round(4 * rest / 2**20, 2)
    assert table["bf16"]["norms, embeddings, lm_head, MiB"] == round(2 * rest / 2**20, 2)
    for column in ("4-bit weights and statistics, MiB", "adapters, MiB"):
        assert table["prepare"][column] == table["bf16"][column] > 0
    assert all(row["step's peak, MiB"] > 0 and row["step's peak tiled, MiB"] > 0 for row in table.values())
