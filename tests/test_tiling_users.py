"""Sequence tiling where users run it: the Trainer with its defaults, generate, autocast, dropout,
torch.compile, pickling, bad input; and the gradient always the gradient of the loss reported.

The finite-difference checks run a float64 model whose loss transformers still computes in
float32 (its `.float()` upcast): the central difference of the reported loss is held to 1% of
the analytic directional derivative, the float32 rounding being far below that.
"""

from __future__ import annotations

import copy
import inspect
import io
import logging
import types

import pytest
import torch
from conftest import (
    VOCAB,
    assert_bit_identical,
    directional_derivatives,
    enable_sim,
    quiet_training_args,
    tiny_model,
    twin,
)
from peft import LoraConfig, get_peft_model
from test_tiling import FLOAT64, SEQ, TILE, assert_close, build, ids, step
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_offload
from hf_offload.tiling import loss as loss_tiling
from hf_offload.tiling.replay import Replay


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield


def lora(model, **options):
    config = dict(r=4, target_modules="all-linear", init_lora_weights=False, **options)
    return get_peft_model(model, LoraConfig(**config))


# -- the forward's signature, which the Trainer and generate read ----------------------------------


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_forward_signature_is_the_models_own_through_peft_and_accelerate():
    """The Trainer keeps dataset columns by `inspect.signature(model.forward)` and generate asks it
    for `logits_to_keep`: enabling tiling and offloading changes neither, on the model, on a
    PeftModel's base, and after accelerate's bf16 prepare rewraps the forward."""
    from accelerate import Accelerator

    model = tiny_model("llama")
    before = inspect.signature(model.forward)
    layer_before = inspect.signature(model.model.layers[0].forward)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    enable_sim(model)
    assert inspect.signature(model.forward) == before
    assert inspect.signature(model.model.layers[0].forward) == layer_before
    assert inspect.signature(model.model.layers[0].mlp.forward) == inspect.signature(
        types.MethodType(type(model.model.layers[0].mlp).forward, model.model.layers[0].mlp)
    )
    assert model._supports_logits_to_keep()
    peft_model = lora(tiny_model("llama"))
    base_before = inspect.signature(peft_model.get_base_model().forward)
    hf_offload.enable_sequence_tiling(peft_model, tile_tokens=TILE)
    assert inspect.signature(peft_model.get_base_model().forward) == base_before
    prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    assert inspect.signature(prepared.forward) == before


def trainer_losses(tmp_path, model, collator=None):
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row)} for row in ids(seed=3, batch=8)]
    if collator is not None:  # packing collators take lists of ids
        data = [{key: value.tolist() for key, value in example.items() if key != "attention_mask"} for example in data]
    arguments = TrainingArguments(**quiet_training_args(tmp_path))
    trainer = Trainer(model=model, args=arguments, train_dataset=data, data_collator=collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("tuning,collator", [("full", None), ("lora", None), ("lora", "DataCollatorWithFlattening")])
def test_the_trainer_with_its_default_arguments_trains_a_tiled_model(tmp_path, tuning, collator):
    """remove_unused_columns=True (the default) keeps the columns the forward's signature names,
    also for a PeftModel and with a packing collator: the tiled run trains, and logs the untiled
    run's losses."""
    import transformers

    plain = build("llama", dtype=torch.float32, tuning=tuning)
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    make = getattr(transformers, collator) if collator else None
    expected = trainer_losses(tmp_path / "plain", plain, make and make())
    actual = trainer_losses(tmp_path / "tiled", tiled, make and make())
    assert len(actual) == len(expected) == 3
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_generate_keeps_only_the_last_logits_under_tiling():
    """generate's prefill asks for the last token's logits only (logits_to_keep): lm_head sees one
    position per sequence, as without tiling, and the tokens are the untiled model's."""
    model = build("llama")
    plain = twin(model)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    widths = []
    model.lm_head.register_forward_hook(lambda module, args, output: widths.append(args[0].shape[1]))
    prompt = ids(batch=2)[:, :40]
    generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, plain.generate(prompt, max_new_tokens=3, do_sample=False))
    assert widths == [1, 1, 1]


# -- autocast and random numbers: backward recomputes what forward computed ----------------------


def slice_logits_dtypes(monkeypatch):
    """The dtype of every slice's logits the tiled loss computes, in forward and in backward."""
    from hf_offload.engine import in_backward

    seen = []
    original = loss_tiling._cross_entropy_sum

    def spying(logits, labels, ignore_index):
        seen.append((in_backward(), logits.dtype))
        return original(logits, labels, ignore_index)

    monkeypatch.setattr(loss_tiling, "_cross_entropy_sum", spying)
    return seen


def bf16_autocast_step_on_float32_weights():
    model = build("llama", dtype=torch.float32)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE, mlp=False, norms=False, projections=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids(), labels=ids()).loss
    loss.backward()


def test_the_loss_head_recomputes_under_the_forwards_autocast(monkeypatch):
    """float32 weights under bf16 autocast (the Trainer's bf16=True): each slice's logits are bf16
    in forward, and again in backward."""
    seen = slice_logits_dtypes(monkeypatch)
    bf16_autocast_step_on_float32_weights()
    assert seen == [(False, torch.bfloat16)] * (SEQ // TILE) + [(True, torch.bfloat16)] * (SEQ // TILE)


def test_without_the_autocast_replay_the_head_would_recompute_in_float32(monkeypatch):
    """Companion: a backward that did not restore autocast is caught by the check above."""
    monkeypatch.setattr(Replay, "_autocast", lambda self: torch.autocast("cpu", enabled=False))
    seen = slice_logits_dtypes(monkeypatch)
    bf16_autocast_step_on_float32_weights()
    assert {dtype for in_bwd, dtype in seen if in_bwd} == {torch.float32}


def lora_everywhere_with_dropout():
    model = tiny_model("llama").to(torch.float64)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = get_peft_model(model, LoraConfig(r=4, lora_dropout=0.3, init_lora_weights=False, target_modules=targets))
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    return model


BATCH_INPUTS = {"input_ids": ids(), "labels": ids()}


def test_the_gradient_is_that_of_the_loss_reported_with_dropout_everywhere():
    """Dropout in every LoRA layer (projections, MLP, lm_head), tiled: the analytic directional
    derivative equals the finite difference of the reported loss."""
    analytic, difference = directional_derivatives(lora_everywhere_with_dropout(), BATCH_INPUTS)
    assert abs(analytic) > 1e-3
    assert analytic == pytest.approx(difference, rel=1e-2)


def test_a_loss_head_that_drew_new_dropout_masks_in_backward_is_caught(monkeypatch):
    """Companion: the loss head's recompute without its forward's random state (the defect the
    check above guards) differs from the finite difference."""
    original = Replay.replaying

    def fresh_masks_in_the_loss_head(self, index):
        if self.device.type == "cpu" and _in_loss_backward():
            return self._autocast()
        return original(self, index)

    monkeypatch.setattr(Replay, "replaying", fresh_masks_in_the_loss_head)
    analytic, difference = directional_derivatives(lora_everywhere_with_dropout(), BATCH_INPUTS)
    assert analytic != pytest.approx(difference, rel=1e-2)


def _in_loss_backward() -> bool:
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is loss_tiling._TiledLoss.backward.__code__:
            return True
        frame = frame.f_back
    return False


def test_random_states_are_kept_only_where_something_random_ran(monkeypatch):
    """Without dropout no tiled call keeps a random state; with LoRA dropout every one does."""
    kept = []
    original = Replay.slice_done

    def spy(self, last):
        original(self, last)
        if last:
            kept.append(self.keeps_random_state)

    monkeypatch.setattr(Replay, "slice_done", spy)
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    step(model)
    first = len(kept)
    step(model)  # the second step of a module reuses what its first learnt
    assert first and len(kept) == 2 * first and not any(kept)
    kept.clear()
    model = lora_everywhere_with_dropout()
    step(model)
    layers = model.config.num_hidden_layers
    # A LoRA layer's dropout in each projection and MLP, and in lm_head: those keep states; the
    # norms (the layers' two, and the final norm's own call) draw nothing and keep none.
    assert sum(kept) == layers * 5 + 1 and len(kept) - sum(kept) == layers * 2 + 1


def test_double_backward_through_a_tiled_part_is_refused():
    model = build("llama", attn_implementation="eager")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    loss = model(input_ids=ids(), labels=ids()).loss
    with pytest.raises(RuntimeError, match="double backward .* sequence tiling"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


# -- the deferred logits: only per-token transforms are replayed ----------------------------------


class TransformingLlama(LlamaForCausalLM):
    """A causal LM whose own code transforms its logits between lm_head and the loss, as Gemma 2
    (softcapping) or Cohere (a logit scale) do: `transform(model, logits)`."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.transform(self, self.lm_head(hidden))
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels, vocab_size=VOCAB)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


TRANSFORMS = {
    "cumsum over tokens": lambda model, logits: logits.cumsum(dim=1) * 0.01,
    "in place, per token": lambda model, logits: logits.mul_(0.5).add_(1.0),
    "in place, across tokens": lambda model, logits: logits.masked_fill_(
        torch.arange(SEQ).view(1, SEQ, 1) % 3 == 0, 0.0
    ),
    "softcapping": lambda model, logits: torch.tanh(logits / 3.0) * 3.0,
    "a learnable scale": lambda model, logits: logits * model.scale,
    "by keyword, per token": lambda model, logits: torch.mul(input=logits, other=2.0),
    "an item assigned": lambda model, logits: _assigned(logits),
}
PER_TOKEN = ("in place, per token", "softcapping", "a learnable scale", "by keyword, per token")


def _assigned(logits):
    logits[..., 0] = -3.0  # `__setitem__`: in place, returns nothing
    return logits


def transforming(name):
    model = build("llama")
    transformed = TransformingLlama(model.config).to(torch.float64)
    transformed.load_state_dict(model.state_dict())
    transformed.scale = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
    transformed.transform = TRANSFORMS[name]
    return transformed.train()


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transforms_of_the_logits_give_the_untiled_loss_and_gradients(name, caplog):
    """Per-token transforms are replayed slice by slice (a learnable scale gets its gradient);
    anything else (a cumulative sum across tokens, an in-place fill of some tokens) makes the
    logits real, with one warning, and the step is the untiled one."""
    plain = transforming(name)
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, mlp=False, norms=False, projections=False)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        expected, actual = step(plain), step(tiled)
    assert_close(expected, actual, **FLOAT64)
    assert ("scale" in actual[1]) == (name == "a learnable scale")
    per_token = name in PER_TOKEN
    assert any("runs untiled" in r.getMessage() for r in caplog.records) != per_token
    assert (actual[2].logits is None) == per_token  # made real, the logits are returned as untiled


# -- module hooks on lm_head run for its slices ----------------------------------------------------


def test_lm_head_slices_run_inside_a_call_of_it():
    """The slices are computed inside one call of lm_head in forward and one in backward, so that
    its hooks (where ZeRO-3 gathers, FSDP unshards, users observe) run around them; an output hook
    that changes the logits changes each slice's once, as it changes the whole logits untiled."""
    plain, tiled = build("llama"), build("llama")
    for model in (plain, tiled):
        model.lm_head.register_forward_hook(lambda module, args, output: output * 0.5)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, mlp=False, norms=False, projections=False)
    calls = []
    tiled.lm_head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    expected, actual = step(plain), step(tiled)
    assert_close(expected, actual, **FLOAT64)
    assert calls == [SEQ] * 3  # the model's call, then one around forward's slices and one around backward's


# -- bad input keeps transformers' errors ----------------------------------------------------------


@pytest.mark.parametrize("case", ["labels longer than the inputs", "logits_to_keep with full labels"])
def test_labels_that_do_not_match_the_logits_raise_as_untiled(case):
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    inputs = ids()
    kwargs = {"labels": ids(seq=SEQ + 32)} if case.startswith("labels") else {"labels": inputs, "logits_to_keep": 20}
    with pytest.raises(ValueError) as untiled:
        plain(input_ids=inputs, **kwargs)
    with pytest.raises(ValueError) as error:
        tiled(input_ids=inputs, **kwargs)
    assert str(error.value) == str(untiled.value)


def test_a_model_with_nothing_to_tile_is_named():
    """A BERT encoder with eager attention: no MLP found, no norm in its layers' own children, an
    attention computed by its own function, no lm_head."""
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        attn_implementation="eager")  # fmt: skip
    model = BertModel(config)
    with pytest.raises(hf_offload.UnsupportedModelError, match="nothing to tile in BertModel"):
        hf_offload.enable_sequence_tiling(model)
    assert not hf_offload.is_sequence_tiling(model)


@pytest.mark.parametrize("method", ["enable_sequence_tiling", "enable_activation_offloading"])
def test_positional_options_are_named(method):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=rf"{method}\(\) takes its options as keywords only, got positional 16"):
        getattr(model, method)(16)
    with pytest.raises(TypeError, match="keywords only"):
        getattr(hf_offload, method)(model, 16)


# -- pickling and copying ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_tiled_and_offloaded_model_pickles_and_copies_with_its_features(how):
    """torch.save(model) / copy.deepcopy(model): the copy tiles and offloads as the original
    (engine and learnt state fresh), and trains bit-identically to it."""
    # (PEFT with checkpointing cannot be pickled with or without hf_offload: transformers'
    # enable_input_require_grads registers a local function as a hook.)
    model = build("llama", dtype=torch.float32, tuning="lora")
    model.get_base_model().activation_checkpointing_enable({"use_reentrant": False})
    model.get_base_model().disable_input_require_grads()
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    enable_sim(model)
    step(model)  # learnt state and pooled buffers exist
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    else:
        copied = copy.deepcopy(model)
    assert copied.is_sequence_tiling and copied.is_activation_offloading
    assert inspect.signature(copied.forward) == inspect.signature(model.forward)
    loss, grads, _ = step(model, ids(2))
    copied_loss, copied_grads, output = step(copied, ids(2))
    assert torch.equal(loss, copied_loss) and output.logits is None
    assert_bit_identical(grads, copied_grads)
    assert copied.activation_offloading_stats().offloaded_tensors > 0


# -- torch.compile ------------------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def two_lengths_of_training(model):
    """Two steps at different lengths (dynamic shapes): losses, gradients, outputs."""
    return [step(model, ids(seed=seed, seq=length)) for seed, length in ((1, SEQ), (2, SEQ + 24))]


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_model_with_tiling_and_offloading_equals_eager(caplog):
    """torch.compile(model) with both features: the tiled steps run the model eagerly (said once,
    truthfully), equal to the eager model bit for bit, the loss still tiled."""
    eager = build("llama", dtype=torch.float32, checkpointing="non_reentrant")
    hf_offload.enable_sequence_tiling(eager, tile_tokens=TILE)
    enable_sim(eager)
    compiled_model = twin(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=True)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        expected, actual = two_lengths_of_training(eager), two_lengths_of_training(compiled)
    for (loss, grads, _), (compiled_loss, compiled_grads, output) in zip(expected, actual, strict=True):
        assert torch.equal(loss, compiled_loss) and output.logits is None
        assert_bit_identical(grads, {name.removeprefix("_orig_mod."): g for name, g in compiled_grads.items()})
    said = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(said) == 1 and "runs eagerly" in said[0] and "layer.compile()" in said[0]
    assert compiled_model.activation_offloading_stats().offloaded_tensors > 0


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_layers_with_tiling_and_offloading():
    """Decoder layers compiled one by one: the tiled parts break their graphs and run eagerly;
    offloading on top (enabled on the same compiled model) is bit-identical to tiling alone, and
    both are close to eager tiling."""
    eager = build("llama", dtype=torch.float32, num_hidden_layers=1)  # (each tiled part is a graph break)
    hf_offload.enable_sequence_tiling(eager, tile_tokens=TILE)
    compiled = twin(eager)
    for layer in compiled.model.layers:
        layer.compile(backend="aot_eager", dynamic=True)
    reference, tiled = two_lengths_of_training(eager), two_lengths_of_training(compiled)
    enable_sim(compiled, keep_last_layers=0)
    both = two_lengths_of_training(compiled)
    for expected, actual, offloaded in zip(reference, tiled, both, strict=True):
        assert torch.equal(actual[0], offloaded[0]) and offloaded[2].logits is None
        assert_bit_identical(actual[1], offloaded[1])
        assert_close(expected, actual, rtol=1e-4, atol=1e-6)
    assert compiled.activation_offloading_stats().offloaded_tensors > 0
