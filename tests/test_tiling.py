"""Sequence tiling: the per-token parts of each layer and the loss head, one slice at a time.

Tiling changes the order of sums, so it is held close to untiled training (in float64 tightly,
in float32 and bf16 loosely); offloading stays exact: tiling + offloading is bit-identical to
tiling alone. The tiny models have 64-token sequences and 16-token slices (4 slices).
"""

from __future__ import annotations

import logging
import re
import types

import pytest
import torch
from conftest import VOCAB, assert_bit_identical, enable_sim, tiny_model, twin
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import hf_offload
from hf_offload.engine import in_backward
from hf_offload.tiling import loss as loss_tiling
from hf_offload.tiling import per_token
from hf_offload.tiling.replay import Replay

SEQ, TILE = 64, 16
FLOAT64 = dict(rtol=1e-9, atol=1e-12)
# A float64 model still sums some things in float32, as transformers wrote them: the loss
# (ForCausalLMLoss upcasts the logits with .float()) and Gemma's RMSNorm weight (x.float() times
# 1 + weight.float()). Those sums are held to float32's rounding, the rest to float64's.
SUMMED_IN_FLOAT32 = dict(rtol=1e-5, atol=1e-9)
GEMMA_NORM = re.compile(r"norm\.weight$")
LOOSE = {torch.float32: dict(rtol=2e-3, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=5e-3)}
CHECKPOINTING = {"none": None, "non_reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True}}


def ids(seed: int = 1, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def step(model, inputs=None, **kwargs):
    """One training step: (loss, gradients, the output)."""
    inputs = ids() if inputs is None else inputs
    model.zero_grad(set_to_none=True)
    output = model(input_ids=inputs, labels=inputs, **kwargs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), grads, output


def assert_close(expected, actual, float32_sums=None, **tolerance):
    """Loss and gradients within `tolerance`; where float64 was asked for, the loss and the
    gradients whose names match `float32_sums` within float32's rounding."""
    (expected_loss, expected_grads), (loss, grads) = expected[:2], actual[:2]
    in_float32 = SUMMED_IN_FLOAT32 if tolerance == FLOAT64 else tolerance
    torch.testing.assert_close(loss, expected_loss, **in_float32)
    assert expected_grads.keys() == grads.keys() and grads
    for name in expected_grads:
        held = in_float32 if float32_sums is not None and float32_sums.search(name) else tolerance
        torch.testing.assert_close(grads[name], expected_grads[name], **held, msg=name)


def build(model_type="llama", dtype=torch.float64, tuning="full", checkpointing="none", **overrides):
    model = tiny_model(model_type, **overrides).to(dtype)
    if tuning == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    base = model.get_base_model() if tuning == "lora" else model
    if CHECKPOINTING[checkpointing] is not None:
        base.activation_checkpointing_enable(CHECKPOINTING[checkpointing])
    return model


@pytest.fixture(autouse=True)
def quiet(caplog):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield


# -- close to untiled, exact under offloading ------------------------------------------------------


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_tiling_is_close_to_untiled_in_float64(model_type, tuning, checkpointing):
    plain = build(model_type, tuning=tuning, checkpointing=checkpointing)
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    assert tiled.is_sequence_tiling
    expected, actual = step(plain), step(tiled)
    assert_close(expected, actual, GEMMA_NORM if model_type.startswith("gemma") else None, **FLOAT64)
    assert actual[2].logits is None and expected[2].logits is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiling_is_close_to_untiled_in_lower_precision(dtype):
    plain = build("llama", dtype=dtype, tuning="lora", checkpointing="non_reentrant")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    assert_close(step(plain), step(tiled), **LOOSE[dtype])


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiling_with_offloading_is_bit_identical_to_tiling_alone(model_type, dtype, checkpointing):
    tiled = build(model_type, dtype=dtype, tuning="lora", checkpointing=checkpointing)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    both = twin(tiled)
    enable_sim(both)
    for seed in (1, 2):  # the second step reuses the engine's handles and pooled buffers
        loss, grads, _ = step(tiled, ids(seed))
        loss_both, grads_both, _ = step(both, ids(seed))
        assert torch.equal(loss, loss_both)
        assert_bit_identical(grads, grads_both)
    stats = both.activation_offloading_stats()
    assert stats.offloaded_tensors > 0 and stats.restored_tensors >= stats.offloaded_tensors


@pytest.mark.parametrize("order", ["tiling, offloading, peft", "peft, offloading, tiling", "offloading, tiling, peft"])
def test_any_order_of_tiling_offloading_and_peft(order):
    """Enabled in any order, before or after get_peft_model: the same step as tiling last."""
    steps = order.split(", ")
    model = build("llama")
    reference = twin(model)
    for name in steps:
        if name == "tiling":
            hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
        elif name == "offloading":
            enable_sim(model)
        else:
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    reference = get_peft_model(reference, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    reference.load_state_dict(model.state_dict())
    hf_offload.enable_sequence_tiling(reference, tile_tokens=TILE)
    assert_close(step(reference), step(model), rtol=0, atol=0)
    lora = next(m for n, m in model.named_modules() if n.endswith("self_attn.q_proj"))
    assert per_token.is_tiled(lora)  # the LoRA layer as a whole, its float32 casts included


def dropout_mlp_pair():
    """GPT-2, whose MLP ends in dropout: tiled, and a reference whose MLP runs the same slices in
    the same order with autograd keeping everything (so it draws the same dropout masks)."""
    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                  resid_pdrop=0.5, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    tiled = AutoModelForCausalLM.from_config(config).to(torch.float64).train()
    reference = twin(tiled)
    for block in reference.transformer.h:
        mlp_forward = block.mlp.forward
        slices = lambda x, f=mlp_forward: [f(x[:, s : s + TILE].clone()) for s in range(0, SEQ, TILE)]  # noqa: E731
        block.mlp.forward = lambda x, slices=slices: torch.cat(slices(x), 1)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, norms=False, projections=False, loss=False)
    return reference, tiled


def seeded_step(model):
    torch.manual_seed(7)
    return step(model)


def test_backward_recomputes_each_slice_with_its_forward_dropout_mask():
    reference, tiled = dropout_mlp_pair()
    assert_close(seeded_step(reference), seeded_step(tiled), **FLOAT64)


def test_without_replaying_the_random_state_the_masks_would_differ(monkeypatch):
    """Companion: a backward that recomputed the slices with fresh random numbers is caught."""
    reference, tiled = dropout_mlp_pair()
    monkeypatch.setattr(Replay, "replaying", lambda self, index: self._autocast())
    with pytest.raises(AssertionError):
        assert_close(seeded_step(reference), seeded_step(tiled), **FLOAT64)


def doubling_mlps(model):
    """Each MLP doubles its input in place before computing (legal in autograd here: nothing
    saved it); a tiling that handed the MLP views of its saved input would double that too."""
    for layer in model.model.layers:
        forward = layer.mlp.forward
        layer.mlp.forward = lambda x, forward=forward: forward(x.mul_(2))
    return model


def test_a_module_that_changes_its_input_in_place_gets_copies():
    plain, tiled = doubling_mlps(build("llama")), doubling_mlps(build("llama"))  # one seed: the same weights
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, norms=False, projections=False, loss=False)
    inputs = ids(batch=1)  # one row: a slice is contiguous, so only the copy protects it
    assert_close(step(plain, inputs), step(tiled, inputs), **FLOAT64)


def test_handed_views_such_a_module_would_corrupt_its_saved_input(monkeypatch):
    """Companion: with the learnt 'changes its input' forced off, the forward doubles the saved
    input's slices and the recompute's in-place change of its slice is refused by autograd."""
    plain, tiled = doubling_mlps(build("llama")), doubling_mlps(build("llama"))
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, norms=False, projections=False, loss=False)
    original = per_token._Signature.__init__

    def never_changes(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.changes_its_input = False

    monkeypatch.setattr(per_token._Signature, "__init__", never_changes)
    inputs = ids(batch=1)
    with pytest.raises((AssertionError, RuntimeError), match="in-place operation|not close"):
        assert_close(step(plain, inputs), step(tiled, inputs), **FLOAT64)


# -- what is saved, and what is not tiled ----------------------------------------------------------


def saved_inside(module: torch.nn.Module, model, inputs):
    """The tensors autograd saves while `module` runs in one training step's forward (tiling's
    backward calls the module again, slice by slice, to recompute it)."""
    saved = []

    def pre(mod, args):
        if in_backward():
            return
        mod._recording = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        mod._recording.__enter__()

    def post(mod, args, output):
        if in_backward():
            return
        mod._recording.__exit__(None, None, None)
        del mod._recording

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        step(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return saved


def test_a_tiled_mlp_saves_only_its_input():
    model = build("llama", dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    untiled = saved_inside(mlp, model, ids())
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    recorded_input = []
    mlp.register_forward_pre_hook(lambda module, args: recorded_input.append(args[0]))
    tiled = saved_inside(mlp, model, ids())
    assert len(untiled) > 3  # gate, up, the product, ...: the companion, for contrast
    assert len(tiled) == 1 and tiled[0] is recorded_input[0]


def mlp_slices_run(model, monkeypatch) -> list[int]:
    """How many slices the first layer's MLP runs in each of two training steps."""
    mlp = model.model.layers[0].mlp
    original = type(mlp).forward
    calls = []
    monkeypatch.setattr(type(mlp), "forward", lambda self, x: (self is mlp and calls.append(1)) or original(self, x))
    counts = []
    for seed in (1, 2):
        calls.clear()
        step(model, ids(seed))
        counts.append(len(calls))
    return counts


def test_inside_a_checkpoint_the_mlp_runs_once_in_forward_and_once_in_backward(monkeypatch):
    """The recompute stops at the tiled MLP's saved input (the layer's last saved tensor), so its
    slices run in forward and in backward only: as often as the untiled MLP runs whole."""
    model = build("llama", checkpointing="non_reentrant")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    assert mlp_slices_run(model, monkeypatch) == [2 * SEQ // TILE] * 2


def test_without_the_early_stop_the_recompute_would_run_the_slices_again(monkeypatch):
    """Companion: with PyTorch's early stop off, the count sees the recompute's third pass."""
    model = build("llama", checkpointing="non_reentrant")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        assert mlp_slices_run(model, monkeypatch) == [3 * SEQ // TILE] * 2


def test_sequences_at_or_under_one_tile_are_not_tiled(monkeypatch):
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=SEQ)
    applied = []
    monkeypatch.setattr(per_token._TiledMLP, "apply", lambda *args: applied.append(1))
    monkeypatch.setattr(loss_tiling._TiledLoss, "apply", lambda *args: applied.append(1))
    calls = []
    mlp = model.model.layers[0].mlp
    original = type(mlp).forward
    counted = lambda self, x: (self is mlp and calls.append(x.shape)) or original(self, x)  # noqa: E731
    monkeypatch.setattr(type(mlp), "forward", counted)
    plain = build("llama")
    plain.load_state_dict(model.state_dict())
    assert_close(step(plain), step(model), rtol=0, atol=0)
    assert not applied and calls == [torch.Size([2, SEQ, 32])]


def test_eval_no_grad_and_generate_are_untouched():
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    plain = build("llama")
    plain.load_state_dict(model.state_dict())
    inputs = ids()
    for each in (model, plain):
        each.eval()
    with torch.no_grad():
        tiled_out, plain_out = model(input_ids=inputs, labels=inputs), plain(input_ids=inputs, labels=inputs)
    assert torch.equal(tiled_out.logits, plain_out.logits) and torch.equal(tiled_out.loss, plain_out.loss)
    generated = model.generate(inputs[:, :8], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, plain.generate(inputs[:, :8], max_new_tokens=4, do_sample=False))


def test_the_missing_logits_are_said_once(caplog):
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in (1, 2):
            assert step(model, ids(seed))[2].logits is None
    said = [r for r in caplog.records if "outputs.logits is None" in r.getMessage()]
    assert len(said) == 1


def test_loss_off_keeps_the_logits():
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE, loss=False)
    assert step(model)[2].logits is not None
    assert not loss_tiling.is_tiled(model)


# -- the loss head against transformers' loss ------------------------------------------------------


def test_the_tiled_loss_never_holds_the_whole_logits():
    """The loss head's tensors of vocabulary width exist for one slice at a time: the largest
    tensor autograd saves or that is live in the loss head's ops is a slice's."""
    vocab = 4096
    model = build("llama", dtype=torch.float32, vocab_size=vocab)
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE, mlp=False, norms=False, projections=False)
    widest = []
    original = loss_tiling._cross_entropy_sum

    def spying(logits, labels, ignore_index):
        widest.append(logits.numel())
        return original(logits, labels, ignore_index)

    loss_tiling._cross_entropy_sum = spying
    try:
        step(model, ids(vocab=vocab))
    finally:
        loss_tiling._cross_entropy_sum = original
    assert widest and max(widest) == 2 * TILE * vocab  # batch x slice x vocabulary, never batch x 64 x vocabulary


def test_the_tiled_loss_matches_transformers_with_ignored_labels_and_num_items_in_batch():
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    inputs = ids()
    labels = inputs.clone()
    labels[0, :20] = -100
    labels[1, 40:] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(50)}, {"num_items_in_batch": 50}):
        expected, actual = [], []
        for model, out in ((plain, expected), (tiled, actual)):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=inputs, labels=labels, **kwargs).loss
            loss.backward()
            out.extend([loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}])
        assert_close(expected, actual, **FLOAT64)


def test_the_tiled_loss_matches_with_shift_labels():
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    inputs = ids()
    shifted = torch.cat([inputs[:, 1:], torch.full((2, 1), -100)], dim=1)
    assert_close(step(plain, shift_labels=shifted), step(tiled, shift_labels=shifted), **FLOAT64)


def test_final_logit_softcapping_and_tied_embeddings():
    """Gemma 2 scales, tanh-caps and rescales its logits between lm_head and the loss, and ties
    lm_head to the embeddings: the recorded transforms run on every slice, and the tied weight's
    gradient (from the embeddings and the head) is close."""
    plain = build("gemma2", final_logit_softcapping=5.0, tie_word_embeddings=True, query_pre_attn_scalar=8,
                  sliding_window=16)  # fmt: skip
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    assert_close(step(plain), step(tiled), GEMMA_NORM, **FLOAT64)


def test_a_transform_that_is_not_per_token_makes_the_logits_real(caplog):
    """A model whose code reshapes its logits across tokens before the loss (as a model computing its
    own cross-entropy on logits.view(-1, vocab) does): the tiled loss cannot do that slice by
    slice, says so, and the step runs as without tiling."""
    plain = build("llama")
    tiled = twin(plain)
    for model in (plain, tiled):
        forward = type(model).forward

        def narrowed(self, *args, _forward=forward, **kwargs):
            head = self.lm_head
            original, own = head.forward, head.__dict__.get("forward")
            head.forward = lambda hidden: original(hidden).flatten(0, 1).unflatten(0, hidden.shape[:2])
            try:
                return _forward(self, *args, **kwargs)
            finally:
                head.__dict__.pop("forward")
                if own is not None:
                    head.forward = own

        model.forward = types.MethodType(narrowed, model)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, mlp=False, norms=False, projections=False)
    inputs = ids()
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        assert_close(step(plain, inputs), step(tiled, inputs), rtol=0, atol=0)
    assert any("runs untiled" in r.getMessage() for r in caplog.records)


# -- mixture of experts ----------------------------------------------------------------------------


def moe_model(model_type):
    config = AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_experts=4,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_router_logits_and_load_balancing_loss_come_out_right(model_type):
    """One router-logits entry per layer covering every token, in token order, differentiable: the
    load-balancing loss (with a padding mask, which reads the entries row by row) and the router's
    gradient are as without tiling."""
    plain = moe_model(model_type)
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    inputs = ids(seq=48)
    mask = torch.ones_like(inputs)
    mask[1, :5] = 0
    expected, actual = step(plain, inputs, attention_mask=mask), step(tiled, inputs, attention_mask=mask)
    assert_close(expected, actual, rtol=1e-4, atol=1e-6)
    plain_out, tiled_out = expected[2], actual[2]
    assert len(tiled_out.router_logits) == len(plain_out.router_logits) == 2
    for mine, theirs in zip(tiled_out.router_logits, plain_out.router_logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled_out.aux_loss, plain_out.aux_loss, rtol=1e-5, atol=1e-7)
    routers = [name for name in expected[1] if "gate.weight" in name and "mlp" in name]
    assert routers and all(name in actual[1] for name in routers)


def test_without_reassembly_the_router_logits_would_be_per_slice(monkeypatch):
    """Companion: were the slices' records left in place, a layer would leave one entry per slice."""
    model = moe_model("qwen3_moe")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    monkeypatch.setattr(per_token, "active_collector", lambda: None)  # the slices' records stay where they are
    output = model(input_ids=ids(seq=48), labels=ids(seq=48))
    assert len(output.router_logits) == 2 * 3


# -- switching it on and off ----------------------------------------------------------------------


def test_disabling_restores_every_module_exactly():
    model = build("llama", tuning="lora")
    before = {name: dict(module.__dict__) for name, module in model.named_modules()}
    hooks_before = {name: dict(module._forward_pre_hooks) for name, module in model.named_modules()}
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    step(model)  # the projections are tiled at the attention's first call
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)  # again: reconfigures, never stacks
    hf_offload.disable_sequence_tiling(model)
    assert not model.is_sequence_tiling
    for name, module in model.named_modules():
        assert module.__dict__.keys() == before[name].keys(), name
        assert dict(module._forward_pre_hooks) == hooks_before[name], name


def wrap_forward_again(module):
    """What accelerate's prepare does to a model's forward (its autocast and fp32-output wrapper):
    an instance-level forward put over whatever forward the instance had."""
    inner = module.forward

    def forward(*args, **kwargs):
        return inner(*args, **kwargs)

    module.forward = forward


def wrapped_after_tiling():
    model = build("llama")
    reference = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    wrap_forward_again(model)  # over the tiled loss's wrapper
    for layer in model.model.layers:
        wrap_forward_again(layer.mlp)  # over a tiled MLP's
    return model, reference


def test_disabling_under_a_later_wrapper_leaves_a_pass_through_and_enabling_reuses_it():
    """Another wrapper put over tiling's after it was enabled keeps working: disabling leaves ours
    in its chain as a pass-through (untiled results, training goes on), and enabling again tiles
    through the same wrapper, never a second one."""
    model, reference = wrapped_after_tiling()
    untiled = step(reference)
    assert_close(untiled, step(model), **FLOAT64)
    hf_offload.disable_sequence_tiling(model)
    assert not model.is_sequence_tiling
    torch.testing.assert_close(step(model)[0], untiled[0], rtol=0, atol=0)  # a pass-through: untiled exactly
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    assert model.is_sequence_tiling
    assert step(model)[2].logits is None  # the tiled loss again, through the one wrapper
    assert_close(untiled, step(model), **FLOAT64)


def test_removing_the_state_from_under_a_later_wrapper_would_break_training(monkeypatch):
    """Companion: a disable that deletes tiling's state whatever holds its wrapper ends the next
    step with an error, which the pass-through avoids."""
    from hf_offload import instance_forward

    def remove_regardless(module, wrapper, state_attr):
        module.__dict__.pop(state_attr, None)
        return True

    model, _reference = wrapped_after_tiling()
    monkeypatch.setattr(instance_forward, "remove", remove_regardless)
    hf_offload.disable_sequence_tiling(model)
    with pytest.raises(KeyError):
        step(model)


@pytest.mark.parametrize(
    "options,error,fragment",
    [
        ({"tile_tokens": 0}, ValueError, "option tile_tokens must be an int >= 1 or None, got 0"),
        ({"tile_tokens": 2.5}, TypeError, "option tile_tokens must be an int >= 1 or None, got 2.5"),
        ({"mlp": "yes"}, TypeError, "option mlp must be True or False"),
        ({"mlp": False, "norms": False, "projections": False, "attention": False, "loss": False}, ValueError,
         "tiles nothing"),
        ({"tiles": 4}, TypeError, "unknown sequence tiling option(s) 'tiles'"),
    ],
)
def test_bad_options_are_named(options, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        hf_offload.enable_sequence_tiling(build("llama"), **options)


def test_an_unsupported_model_is_named():
    class NotALanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    with pytest.raises(hf_offload.UnsupportedModelError, match="NotALanguageModel"):
        hf_offload.enable_sequence_tiling(NotALanguageModel())


# -- attention tiled over heads --------------------------------------------------------------------


def test_attention_runs_a_group_of_key_value_heads_at_a_time(monkeypatch):
    """Each attention call is split into one call per key/value head with its query heads (4 query
    and 2 key/value heads here), bit-identical to the whole call; eval calls are whole; disabling
    the last tiled model gives transformers' registry back its own functions."""
    import weakref

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_offload.tiling import attention

    registry = type(ALL_ATTENTION_FUNCTIONS)._global_mapping
    original = getattr(registry["sdpa"], "_hf_offload_heads_of", registry["sdpa"])
    # This test's own registry state (models of other tests may still be alive, tiled).
    monkeypatch.setitem(registry, "sdpa", original)
    monkeypatch.setattr(attention, "_originals", {})
    monkeypatch.setattr(attention, "_live", weakref.WeakSet())
    plain = build("llama", dtype=torch.float32)
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, mlp=False, norms=False, projections=False, loss=False)
    wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert wrapper._hf_offload_heads_of is original
    calls = []

    def spy(module, query, key, value, mask, **kwargs):
        calls.append((query.shape[1], key.shape[1]))
        return original(module, query, key, value, mask, **kwargs)

    registry["sdpa"] = attention._head_tiled(spy, "sdpa")
    expected = step(plain)
    calls.clear()
    assert_close(expected, step(tiled), rtol=0, atol=0)
    layers = tiled.config.num_hidden_layers
    assert calls == [(2, 1)] * 2 * layers  # two groups per call, in forward only: nothing is recomputed
    calls.clear()
    tiled.eval()  # eval mode runs whole, with or without grad (training mode splits under no_grad too)
    tiled(input_ids=ids())
    assert calls == [(4, 2)] * layers
    tiled.train()
    registry["sdpa"] = wrapper
    hf_offload.disable_sequence_tiling(tiled)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original


def _norm_widths(monkeypatch, model) -> list[int]:
    """The widths of the final norm's forwards (its class's), appended as they run."""
    norm, widths = model.model.norm, []
    original = type(norm).forward

    def spying(self, x):
        if self is norm:
            widths.append(x.shape[1])
        return original(self, x)

    monkeypatch.setattr(type(norm), "forward", spying)
    return widths


def test_the_final_norm_runs_slice_by_slice_with_the_loss_head(monkeypatch):
    """The final norm is per token: lm_head's slices are computed from the norm's input, the norm
    running slice by slice with the head in forward and in backward; the model's own call of the
    norm runs a slice at a time too, and its output is used no further (else the float64 gradients
    would count the norm twice); the norm's weight gets its gradient."""
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, mlp=False, projections=False)  # norms: the final one too
    widths = _norm_widths(monkeypatch, tiled)
    expected, actual = step(plain), step(tiled)
    assert_close(expected, actual, **FLOAT64)
    assert "model.norm.weight" in actual[1]
    # The model's call, then the loss head's slices in forward and in backward: never the whole sequence.
    assert widths == [TILE] * (3 * SEQ // TILE)


def test_the_final_norm_runs_slice_by_slice_without_the_loss_head(monkeypatch):
    """Where the loss head is not ours (loss=False here; TRL's fused head and Liger's fused
    cross-entropy take the backbone's last hidden state), the final norm is a tiled per-token
    module of its own: a slice at a time in forward and in backward (recomputed), close to untiled."""
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, mlp=False, projections=False, loss=False)
    assert per_token.is_tiled(tiled.model.norm)
    widths = _norm_widths(monkeypatch, tiled)
    assert_close(step(plain), step(tiled), **FLOAT64)
    assert widths == [TILE] * (2 * SEQ // TILE)


def test_a_final_norm_with_hooks_is_not_chained_and_its_hooks_count():
    """A forward hook on the final norm that changes its output changes the tiled loss as it
    changes the untiled one; a hook that captures the output gets the norm's real output in
    forward (a norm with hooks is not chained into the loss head, where its hooks would see
    the deferred logits and their changes be lost; it runs tiled on its own)."""
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    for model in (plain, tiled):
        model.model.norm.register_forward_hook(lambda module, args, output: output * 2.0)
    captured = []
    tiled.model.norm.register_forward_hook(lambda module, args, output: captured.append(output))
    expected, actual = step(plain), step(tiled)
    assert_close(expected, actual, **FLOAT64)
    # Once, around the forward's slices, with the real output; never with the deferred logits.
    assert [(type(t), tuple(t.shape)) for t in captured] == [(torch.Tensor, (2, SEQ, tiled.config.hidden_size))]
    assert captured[0].untyped_storage().nbytes() == captured[0].nbytes


def test_a_global_hook_sees_the_chained_final_norm_once_with_its_real_output():
    """torch's global forward hooks (which do not unchain the final norm: the memory simulator's
    attribution is one) see the final norm once per step, in the model's own call, with its real
    output, and the loss stays tiled. (The loss head's own calls called the chained norm too,
    handing such a hook lm_head's deferred logits as the norm's output: reading them raised an error
    naming lm_head's hooks.)"""
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    norms, seen = {plain.model.norm: "plain", tiled.model.norm: "tiled"}, []

    def hook(module, args, output):
        if module in norms:
            seen.append((norms[module], tuple(output.shape), output.mean().item()))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        expected, actual = step(plain), step(tiled)
    finally:
        handle.remove()
    assert_close(expected, actual, **FLOAT64)
    assert actual[2].logits is None  # the loss was tiled
    (_, shape, plain_mean), (_, tiled_shape, tiled_mean) = seen
    assert [name for name, *_ in seen] == ["plain", "tiled"] and tiled_shape == shape == (2, SEQ, 32)
    assert tiled_mean == pytest.approx(plain_mean, rel=1e-9, abs=1e-15)


def test_a_tiled_modules_hooks_run_once_per_step_as_untiled():
    """A tiled module's slices run inside one call of it in forward, and its backward is no call of
    it: its hooks run once per step whatever the number of slices, as untiled (a backward calling
    it once per slice ran them 1 + 4 times here, one driven call around the slices twice); the
    MLP's projections, which its forward calls, once per slice each way."""
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE, loss=False)
    layer = model.model.layers[0]
    counts = {}
    for name, module in (("norm", layer.input_layernorm), ("mlp", layer.mlp), ("gate", layer.mlp.gate_proj)):
        module.register_forward_pre_hook(lambda module, args, name=name: counts.update({name: counts.get(name, 0) + 1}))
    step(model)
    assert counts == {"norm": 1, "mlp": 1, "gate": 2 * SEQ // TILE}


# The final norm (tiled on its own once it has a hook: not chained into the loss head) and an MLP,
# with a bound their output passes (float64 tiny Llama: |norm| up to 3.2, |mlp| up to 4e-3).
HOOKED = {"final_norm": (lambda model: model.model.norm, 1.0), "mlp": (lambda model: model.model.layers[0].mlp, 1e-3)}


@pytest.mark.parametrize("where", sorted(HOOKED))
def test_a_hook_that_clamps_a_tiled_modules_output_in_place_trains_as_untiled(where):
    """`output.clamp_(-bound, bound)` in a forward hook changes the step (checked), tiled as
    untiled. (A backward that called the module again with a one-element stand-in expanded to the
    output's shape made the hook raise "more than one element of the written-to tensor refers to a
    single memory location".)"""
    module_of, bound = HOOKED[where]
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    unhooked_loss = step(plain)[0]
    for model in (plain, tiled):
        module_of(model).register_forward_hook(lambda module, args, output: output.clamp_(-bound, bound))
    expected, actual = step(plain), step(tiled)
    assert not torch.isclose(expected[0], unhooked_loss, rtol=1e-6, atol=0)
    assert_close(expected, actual, **FLOAT64)


@pytest.mark.parametrize("where", sorted(HOOKED))
def test_a_hook_that_logs_a_tiled_modules_output_reads_the_real_output_once_per_step(where):
    """A logging hook records the output's mean and whether it is finite once per step, the values
    untiled training records. (A backward that called the module again handed it one uninitialised
    element as the whole output: a second record of 4.7e-310, or nan under deterministic
    algorithms, and False for the finite check.)"""
    module_of, _bound = HOOKED[where]
    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    logs = []
    for model in (plain, tiled):
        log = []
        module_of(model).register_forward_hook(
            lambda module, args, output, log=log: log.append((output.mean().item(), bool(output.isfinite().all())))
        )
        step(model)
        logs.append(log)
    (expected,), (actual,) = logs  # one record each
    assert actual[1] is expected[1] is True
    assert actual[0] == pytest.approx(expected[0], rel=1e-9, abs=1e-15)


def test_a_wrapper_of_a_tiled_modules_forward_runs_around_its_slices_each_way():
    """accelerate's device hooks wrap a module's forward (add_hook_to_module, after tiling) and have
    no backward hooks: the backward's slices run inside them, as the forward's do, so a hook that
    loads the weights before the forward runs before the backward's slices too (twice per step;
    each slice in backward was a call of its own before: 1 + 4)."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    plain = build("llama")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE, loss=False)
    add_hook_to_module(tiled.model.layers[0].mlp, Counting())
    assert_close(step(plain), step(tiled), **FLOAT64)
    assert Counting.calls == 2


def _held_after_the_step(model) -> list[str]:
    """What of the final norm's whole input and of its gradient is still alive after a step and
    the output dropped, with the garbage collector off: what only a reference cycle keeps (on a
    GPU, memory held until the collector happens to run)."""
    import gc
    import weakref

    # The last layer's output is the final norm's input (a hook on the norm itself would unchain it).
    last, seen = model.model.layers[-1], {}

    def record(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] == SEQ and "input" not in seen:
            seen["input"] = weakref.ref(hidden)
            hidden.register_hook(lambda grad: seen.update(gradient=weakref.ref(grad)))

    handle = last.register_forward_hook(record)
    gc.collect()
    gc.disable()
    try:
        output = model(input_ids=ids(), labels=ids())
        output.loss.backward()
        del output
        return [name for name, reference in seen.items() if reference() is not None]
    finally:
        gc.enable()
        handle.remove()


def test_the_tiled_loss_head_holds_the_hidden_states_in_no_reference_cycle():
    """The loss head's slices run inside one driven call of each stage: nothing of that leaves a
    reference cycle behind, so the final norm's whole input and its gradient are freed as soon as
    nothing uses them, not whenever Python's garbage collector next runs (the simulator, which
    counts frees as they happen, saw its peaks move with the collector's timing)."""
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    assert _held_after_the_step(model) == []


def test_the_reference_cycle_check_catches_a_cycle_holding_the_hidden_states(monkeypatch):
    """Companion: a driven call that leaves its hidden states in a reference cycle (as a recursive
    closure does) is caught."""
    model = build("llama")
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    original = loss_tiling._Source.inside_a_call

    def leaving_a_cycle(self, work, hidden=None):
        result = original(self, work, hidden)
        cycle = [hidden if hidden is not None else self.hidden, result]
        cycle.append(cycle)
        return result

    monkeypatch.setattr(loss_tiling._Source, "inside_a_call", leaving_a_cycle)
    assert _held_after_the_step(model) == ["input", "gradient"]


def test_only_a_mask_laid_out_by_heads_is_split_over_them():
    """A (batch, heads, queries, keys) mask is split with its heads; a padding mask (batch,
    tokens) is not, even where its length equals the head count (a split would give each group
    the wrong positions' mask)."""
    from hf_offload.tiling.attention import _SCORES_HEADS, _per_group

    by_heads = torch.arange(2 * 8 * 3 * 3).view(2, 8, 3, 3)
    parts = _per_group(by_heads, _SCORES_HEADS, heads=8, groups=2)
    assert [tuple(part.shape) for part in parts] == [(2, 4, 3, 3)] * 2
    padding = torch.ones(2, 8)
    assert all(part is padding for part in _per_group(padding, _SCORES_HEADS, heads=8, groups=2))


def _attention_norm_shapes(monkeypatch, model) -> list[tuple[int, ...]]:
    """The input shapes of the first layer's q_norm (its class's forward), appended as it runs."""
    norm, shapes = model.model.layers[0].self_attn.q_norm, []
    original = type(norm).forward

    def spying(self, x):
        if self is norm:
            shapes.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(type(norm), "forward", spying)
    return shapes


def test_the_attentions_own_norms_run_a_slice_at_a_time(monkeypatch):
    """Qwen3 normalises each head's queries and keys inside its attention, on (batch, tokens, heads,
    head_dim): its q_norm and k_norm are tiled with the layer's norms, a slice at a time in forward
    and in backward (recomputed), close to untiled in float64, their weights getting gradients."""
    plain = build("qwen3")
    tiled = twin(plain)
    hf_offload.enable_sequence_tiling(tiled, tile_tokens=TILE)
    attention = tiled.model.layers[0].self_attn
    assert per_token.is_tiled(attention.q_norm) and per_token.is_tiled(attention.k_norm)
    shapes = _attention_norm_shapes(monkeypatch, tiled)
    expected, actual = step(plain), step(tiled)
    assert_close(expected, actual, **FLOAT64)
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= actual[1].keys()
    heads, head_dim = attention.config.num_attention_heads, attention.head_dim
    assert shapes == [(2, TILE, heads, head_dim)] * (2 * SEQ // TILE)


def _head_spanning_norm():
    """A norm whose weight spans (heads, head_dim) of a (batch x tokens, heads, head_dim) input,
    as Chameleon's q_norm: dim 1 is its heads, which it does not compute apart."""
    norm = torch.nn.LayerNorm((8, 4), dtype=torch.float64)
    torch.nn.init.normal_(norm.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(6, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return norm, x, norm(x)


def test_a_norm_whose_weight_spans_dim_1_runs_whole():
    norm, x, expected = _head_spanning_norm()
    per_token.install(norm, 2)  # fewer "tokens" per slice than its 8 heads
    assert torch.equal(norm(x), expected)


def test_sliced_along_dim_1_such_a_norm_would_fail(monkeypatch):
    norm, x, _expected = _head_spanning_norm()
    monkeypatch.setattr(per_token, "_sliceable_along_dim_1", lambda module, hidden: hidden.dim() >= 3)
    per_token.install(norm, 2)
    with pytest.raises(RuntimeError):
        norm(x)


def replicated(module: torch.nn.Module, scale: float) -> torch.nn.Module:
    """What nn.DataParallel's `replicate` makes of `module` for another GPU, on the CPU: each module's
    `_replicate_for_data_parallel()`, the children wired to their replicas, and weights of the
    replica's own (here `scale` times the original's)."""
    copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for original, copy in copies.items():
        copy._modules = {name: copies[child] for name, child in original._modules.items()}
        for name, parameter in original._parameters.items():
            copy._parameters[name] = None if parameter is None else (parameter.detach() * scale).requires_grad_()
    return copies[module]


def test_data_parallel_replicas_of_tiled_modules_run_their_own_weights():
    """nn.DataParallel copies each module's __dict__ into a replica on another GPU (torch's
    `_replicate_for_data_parallel`, as its `replicate` calls it): a tiled MLP's and norm's replica
    runs a slice at a time with the replica's weights, not the original's, and a replica of a
    replica too; the loss head's is bound to its replica. Disabling takes the override off."""
    model = tiny_model()
    hf_offload.enable_sequence_tiling(model, tile_tokens=TILE)
    layer = model.model.layers[0]
    hidden = torch.randn(2, SEQ, model.config.hidden_size, requires_grad=True)
    for module in (layer.mlp, layer.input_layernorm):
        replica = replicated(replicated(module, 1.0), 2.0)
        assert replica.forward.__self__ is replica and per_token.is_tiled(replica)
        reference = twin(module)
        per_token.uninstall(reference)
        for parameter in reference.parameters():
            parameter.data.mul_(2)
        torch.testing.assert_close(replica(hidden), reference(hidden))
    assert model._replicate_for_data_parallel().forward.__self__ is not model
    hf_offload.disable_sequence_tiling(model)
    assert not [m for m in model.modules() if "_replicate_for_data_parallel" in m.__dict__]
