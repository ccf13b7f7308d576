"""The race checker: the engine's stream and event logic run on CPU with copies that execute
lazily or at random moments, honouring only the orderings the engine issues. Parity under it
shows the orderings are sufficient; the companion tests remove one ordering at a time and show
that the checker then fails."""

from __future__ import annotations

import pytest
import torch
from conftest import batch, tiny_model, train_step, twin
from test_parity import build_pair

import hf_offload
from hf_offload.engine import ActivationOffloader, ordering
from hf_offload.engine.streams import SimulatedStreams, simulated_schedule


def simulated_streams(model) -> SimulatedStreams:
    engine = model.get_base_model()._hf_offload.engine if hasattr(model, "get_base_model") else model._hf_offload.engine
    return engine.device_context("cpu").streams


def identical_steps(plain, offloaded, steps=2):
    for step in range(steps):
        expected_loss, expected = train_step(plain, batch(seed=step))
        loss, actual = train_step(offloaded, batch(seed=step))
        if not torch.equal(expected_loss, loss) or any(not torch.equal(expected[k], actual[k]) for k in expected):
            return False
    return True


@pytest.mark.parametrize("schedule", ["lazy", "random"])
@pytest.mark.parametrize("checkpointing", ["none", "non_reentrant", "reentrant"])
@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_parity_under_the_race_checker(model_type, tuning, checkpointing, schedule):
    with simulated_schedule(schedule, seed=7):
        plain, offloaded = build_pair(model_type, tuning, checkpointing)
        assert identical_steps(plain, offloaded)
    streams = simulated_streams(offloaded)
    assert streams.schedule == schedule
    assert streams.violations == []
    stats = hf_offload.activation_offloading_stats(offloaded)
    assert stats.offloaded_tensors > 0
    if checkpointing == "none":
        assert stats.restored_ahead > 0  # copies were really brought back ahead of need


@pytest.mark.parametrize(
    "removed",
    ["before_offload_copies", "before_releasing_sources", "before_restore_copies", "before_using_restored"],
)
def test_checker_catches_each_missing_ordering(removed, monkeypatch):
    monkeypatch.setattr(ordering, removed, lambda *args: None)
    with simulated_schedule("lazy"):
        plain, offloaded = build_pair("llama", "full", "none")
        assert not identical_steps(plain, offloaded)


def test_checker_passes_the_same_setup_with_every_ordering_in_place():
    """The control for the companions above: same model, schedule and steps."""
    with simulated_schedule("lazy"):
        plain, offloaded = build_pair("llama", "full", "none")
        assert identical_steps(plain, offloaded)


def _prefetch_then_stop_early(engine):
    """Backward reaches layer 3 (prefetching layer 2) but stops before layer 2's backward;
    then the graph is dropped with layer 2's copies brought back but never used."""

    def scope(starts_pass):
        return engine.layer_scope(
            training=True,
            device=torch.device("cpu"),
            starts_pass=starts_pass,
            keep=False,
            protected=lambda: (),
            pass_protected=lambda: (),
            name="toy",
        )

    x = torch.randn(4096, requires_grad=True)
    with scope(True):
        h1 = (x * 2).sin()
    with scope(False):
        h2 = (h1 * 3).sin()
    with scope(False):
        h3 = (h2 * 1.5).sin()
    (grad,) = torch.autograd.grad(h3.sum(), h2)
    assert engine.stats().restored_ahead > 0
    del h1, h2, h3, grad
    streams = engine.device_context("cpu").streams
    streams.synchronize()
    return streams


def test_unused_prefetch_is_dropped_only_after_its_copy():
    with simulated_schedule("lazy"):
        streams = _prefetch_then_stop_early(ActivationOffloader(min_offload_bytes=0, simulate_on_cpu=True))
    assert streams.violations == []


def test_checker_catches_dropping_an_unused_prefetch_early(monkeypatch):
    monkeypatch.setattr(ordering, "before_dropping_unused", lambda *args: None)
    with simulated_schedule("lazy"):
        streams = _prefetch_then_stop_early(ActivationOffloader(min_offload_bytes=0, simulate_on_cpu=True))
    assert streams.violations


def test_schedule_names_are_validated():
    with pytest.raises(ValueError, match="schedule must be"), simulated_schedule("sometimes"):
        pass


def test_pinned_pool_is_reused_after_the_first_step():
    plain = tiny_model()
    offloaded = twin(plain)
    offloaded.enable_activation_offloading(simulate_on_cpu=True, min_offload_bytes=0)
    train_step(offloaded, batch())
    first = offloaded.activation_offloading_stats()
    for step in range(3):
        train_step(offloaded, batch(seed=step))
    later = offloaded.activation_offloading_stats()
    assert first.pool_allocations > 0
    assert later.pool_allocations == first.pool_allocations, "a repeated shape allocated a new host buffer"
    assert later.pool_bytes == first.pool_bytes
    assert later.pool_free_bytes == later.pool_bytes  # between steps every buffer is back in the pool
    assert later.host_bytes_held == 0
