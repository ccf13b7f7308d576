"""The handle lifetime follows the autograd graph; the engine does no work outside training;
and the policies (parameters, small tensors, kept layers, duplicates) hold."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_bit_identical,
    assert_same_step,
    batch,
    collect,
    enable_sim,
    grads,
    loss_of,
    tiny_model,
    train_step,
    twin,
)
from routing import parameter_ptrs, spy_host_copies
from torch.utils.checkpoint import checkpoint

import hf_offload
import hf_offload.engine.offloader as offloader_module
from hf_offload import api


def pair(model_type="llama", **options):
    plain = tiny_model(model_type)
    offloaded = twin(plain)
    enable_sim(offloaded, **options)
    return plain, offloaded


def stats(model):
    return hf_offload.activation_offloading_stats(model)


def assert_nothing_held(model):
    collect()
    s = stats(model)
    assert (s.host_bytes_held, s.live_host_copies) == (0, 0)


def test_retain_graph_two_backwards(model_type):
    plain, offloaded = pair(model_type)
    ids = batch()
    results = []
    for model in (plain, offloaded):
        loss = loss_of(model, ids)
        loss.backward(retain_graph=True)
        first = grads(model)
        loss.backward()
        results.append((first, grads(model)))
    assert_bit_identical(results[0][0], results[1][0])
    assert_bit_identical(results[0][1], results[1][1])
    s = stats(offloaded)
    assert s.restored_tensors == 2 * (s.offloaded_tensors + s.kept_tensors["duplicate"])
    del loss
    assert_nothing_held(offloaded)


def test_two_forwards_then_one_backward(model_type):
    plain, offloaded = pair(model_type)
    first, second = batch(1), batch(2)
    for model in (plain, offloaded):
        model.zero_grad()
        (loss_of(model, first) + 2 * loss_of(model, second)).backward()
    assert_bit_identical(grads(plain), grads(offloaded))
    s = stats(offloaded)
    assert s.layers_offloaded == 4  # two forwards of two offloaded layers, counted as one step
    assert_nothing_held(offloaded)


def test_forward_without_backward_leaves_nothing_behind():
    _, offloaded = pair()
    loss = loss_of(offloaded, batch())
    assert stats(offloaded).live_host_copies > 0
    del loss
    assert_nothing_held(offloaded)


def test_exception_inside_a_layer_leaves_the_model_usable(monkeypatch):
    plain, offloaded = pair()
    layer = offloaded.model.layers[1]

    def failing_forward(*args, **kwargs):
        raise RuntimeError("boom inside the mlp")

    monkeypatch.setattr(layer.mlp, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="boom"):
        loss_of(offloaded, batch())
    monkeypatch.undo()
    assert_nothing_held(offloaded)
    # No hooks context left behind: a plain forward outside the model saves normally.
    x = torch.randn(3, requires_grad=True)
    assert x.exp().grad_fn._saved_result is not None
    assert_same_step(plain, offloaded, batch())


@pytest.mark.parametrize(
    "context",
    ["no_grad", "inference_mode", "eval", "generate"],
)
def test_no_work_outside_training(context):
    _, offloaded = pair()
    train_step(offloaded, batch())  # engine warmed up, counters non-zero
    before = stats(offloaded)
    ids = batch()
    if context == "no_grad":
        with torch.no_grad():
            loss_of(offloaded, ids)
    elif context == "inference_mode":
        with torch.inference_mode():
            loss_of(offloaded, ids)
    elif context == "eval":
        offloaded.eval()
        loss_of(offloaded, ids).backward()  # grad enabled, but the model is in eval mode
    else:
        offloaded.generation_config.pad_token_id = 0
        offloaded.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    after = stats(offloaded)
    assert after.total_layer_scopes == before.total_layer_scopes
    assert after.total_pack_calls == before.total_pack_calls
    assert after.total_unpack_calls == before.total_unpack_calls
    assert after.live_host_copies == 0


def test_nothing_is_packed_during_backward():
    """A user's reentrant checkpoint around the whole model re-runs every decoder layer inside
    backward; none of those re-runs may offload."""
    plain, offloaded = pair()
    ids = batch()
    results = []
    for model in (plain, offloaded):
        model.zero_grad()
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = checkpoint(lambda e, m=model: m(inputs_embeds=e).logits, embeds, use_reentrant=True)
        logits.float().logsumexp(-1).mean().backward()
        results.append(grads(model))
    assert_bit_identical(*results)
    s = stats(offloaded)
    assert s.total_layer_scopes == 0 and s.total_pack_calls == 0


def test_backward_guard_is_what_prevents_packing_in_backward(monkeypatch):
    """Companion: without the in-backward checks (the layer wrapper's, which takes a layer run in
    backward for a checkpoint's recompute, and the engine's own), the same recompute does pack."""
    monkeypatch.setattr(offloader_module, "in_backward", lambda: False)
    monkeypatch.setattr(api, "in_backward", lambda: False)
    _, offloaded = pair()
    embeds = offloaded.get_input_embeddings()(batch()).detach().requires_grad_()
    logits = checkpoint(lambda e: offloaded(inputs_embeds=e).logits, embeds, use_reentrant=True)
    logits.float().logsumexp(-1).mean().backward()
    assert stats(offloaded).total_pack_calls > 0


def test_embeddings_norm_lm_head_logits_and_loss_are_never_offloaded(monkeypatch):
    """Everything saved outside the decoder layers (by the embeddings, final norm, lm_head and
    the loss) stays where it is, and so do the logits and the loss. The hidden states entering
    layer 0 are layer 0's input, and may be offloaded as such."""
    _, offloaded = pair(keep_last_layers=0)
    saved_outside = []
    norm_output = {}
    hook = offloaded.model.norm.register_forward_hook(lambda m, a, o: norm_output.setdefault("out", o))
    record = lambda t: saved_outside.append(t) or t.detach()  # noqa: E731
    record_outside = torch.autograd.graph.saved_tensors_hooks(record, lambda t: t)
    # Innermost hooks win: inside a decoder layer the engine's, everywhere else record_outside.
    with spy_host_copies(monkeypatch) as copied, record_outside:
        result = offloaded(input_ids=batch(), labels=batch())
    hook.remove()
    offloaded_ptrs = {s.data_ptr() for s in copied}
    assert offloaded_ptrs and len(saved_outside) >= 3
    for tensor in [*saved_outside, norm_output["out"], result.logits, result.loss]:
        assert tensor.untyped_storage().data_ptr() not in offloaded_ptrs
    assert not offloaded_ptrs & parameter_ptrs(offloaded)


@pytest.mark.parametrize("keep_last_layers", [0, 1, 2, 3])
def test_keep_last_layers(keep_last_layers):
    plain, offloaded = pair(keep_last_layers=keep_last_layers)
    assert_same_step(plain, offloaded, batch())
    s = stats(offloaded)
    assert s.layers_offloaded == 3 - keep_last_layers
    assert (s.kept_tensors["kept_layer"] > 0) == (keep_last_layers > 0)
    assert (s.offloaded_tensors > 0) == (keep_last_layers < 3)


def test_min_offload_bytes_keeps_small_tensors():
    plain, offloaded = pair(min_offload_bytes=10**9)
    assert_same_step(plain, offloaded, batch())
    s = stats(offloaded)
    assert s.offloaded_tensors == 0 and s.kept_tensors["too_small"] > 0
    # A threshold between the sizes splits them.
    hf_offload.enable_activation_offloading(offloaded, simulate_on_cpu=True, min_offload_bytes=1024)
    train_step(offloaded, batch())
    s = stats(offloaded)
    assert s.offloaded_tensors > 0 and s.kept_tensors["too_small"] > 0
    assert s.offloaded_bytes >= 1024 * s.offloaded_tensors


def test_dtype_change_after_enable_never_offloads_parameters(monkeypatch):
    plain, offloaded = pair()
    plain.to(torch.float64)
    offloaded.to(torch.float64)  # every parameter gets a new storage
    with spy_host_copies(monkeypatch) as copied:
        loss, actual = train_step(offloaded, batch())
    expected_loss, expected = train_step(plain, batch())
    assert torch.equal(expected_loss, loss)
    assert_bit_identical(expected, actual)
    assert copied and not {s.data_ptr() for s in copied} & parameter_ptrs(offloaded)
    assert stats(offloaded).kept_tensors["parameter"] > 0


@pytest.mark.parametrize("prefetch_layers", [0, 1, 2])
def test_device_memory_the_engine_holds_is_bounded_by_layers_not_depth(prefetch_layers):
    """Forward: the sources of at most two layers' copies are held (the layer that just ran and
    the one before, whose copy out may still be running). Backward: the layer being
    differentiated plus `prefetch_layers` layers brought back ahead. Neither grows with depth."""
    peaks = []
    for depth in (5, 10):
        model = tiny_model(num_hidden_layers=depth)
        enable_sim(model, prefetch_layers=prefetch_layers)
        for _ in range(2):
            train_step(model, batch())
        s = stats(model)
        layer = s.max_layer_offloaded_bytes
        assert s.layers_offloaded == depth - 1
        assert s.peak_forward_held_bytes <= 2 * layer
        assert s.peak_backward_held_bytes <= (1 + prefetch_layers) * layer
        assert s.offloaded_bytes >= (depth - 1) * 0.9 * layer  # every layer offloaded about as much
        peaks.append((s.peak_forward_held_bytes, s.peak_backward_held_bytes))
    assert peaks[0] == peaks[1]
