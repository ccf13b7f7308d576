"""When the layers' copies come back in backward: with checkpointing at long context, the layer
before comes back once the current layer's attention backward (its peak) is done, not at its
start; never later than its own backward needs it."""

from __future__ import annotations

import pytest
from conftest import assert_same_step, batch, enable_sim, tiny_model, twin

import hf_offload
from hf_offload.engine import offloader
from hf_offload.engine.offloader import DeviceContext

LAYERS = 4


def events_of_a_step(late_bytes: int, monkeypatch, reentrant=False, tiled=False) -> tuple[list, object]:
    """One checkpointed step and, in order: ("attention done", layer) when the gradient of a
    layer's query projection arrives, ("restored", layer) when a layer's copies are queued back."""
    monkeypatch.setattr(offloader, "LATE_PREFETCH_BYTES", late_bytes)
    plain = tiny_model("llama", num_hidden_layers=LAYERS)
    plain.activation_checkpointing_enable({"use_reentrant": reentrant})
    if tiled:
        hf_offload.enable_sequence_tiling(plain, tile_tokens=4, loss=False)
    model = twin(plain)
    events = []
    positions = {}
    original = DeviceContext.restore_async

    def spying(self, copies):
        restored = original(self, copies)
        if restored:
            events.append(("restored", positions.get(id(copies[0]) if copies else None)))
        return restored

    monkeypatch.setattr(DeviceContext, "restore_async", spying)

    def attention_done(module, args, output, index):
        if output.requires_grad:
            output.register_hook(lambda grad: events.append(("attention done", index)))

    for index, layer in enumerate(model.model.layers):  # before offloading's own hook: seen first
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, index=index: attention_done(m, a, o, index))
    enable_sim(model, keep_last_layers=0)
    original_finish = offloader.ActivationOffloader._finish_layer

    def finishing(self, group, context, name):
        original_finish(self, group, context, name)
        for copy in group.copies + group.shared:
            positions[id(copy)] = group.position

    monkeypatch.setattr(offloader.ActivationOffloader, "_finish_layer", finishing)
    assert_same_step(plain, model, batch())
    return events, model


@pytest.mark.parametrize("reentrant,tiled", [(False, False), (True, False), (False, True)])
def test_the_layer_before_comes_back_after_the_attention_backward(monkeypatch, reentrant, tiled):
    events, model = events_of_a_step(0, monkeypatch, reentrant, tiled)
    stats = model.activation_offloading_stats()
    assert stats.restored_on_demand == 1  # the last layer's input, needed first; every other one came back ahead
    for layer in range(LAYERS - 1, 0, -1):
        done = events.index(("attention done", layer))
        restored = events.index(("restored", layer - 1))
        assert restored > done, events
        assert ("attention done", layer - 1) in events[restored:]


def test_below_the_threshold_it_comes_back_at_the_start_of_the_layer_after(monkeypatch):
    """Companion and today's behaviour where the copies are small: the layer before comes back
    when the current layer's backward starts, before its attention's backward."""
    events, model = events_of_a_step(2**62, monkeypatch)
    assert model.activation_offloading_stats().restored_on_demand == 1
    for layer in range(LAYERS - 1, 0, -1):
        assert events.index(("restored", layer - 1)) < events.index(("attention done", layer)), events
