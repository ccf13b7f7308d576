"""Offloading never hurts a run: host-memory budget, failed host allocations, faults at any
point, switching on and off, several models at once, and a long run."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_bit_identical,
    assert_same_step,
    batch,
    collect,
    enable_sim,
    loss_of,
    tiny_model,
    train_step,
    twin,
)

import hf_offload
from hf_offload.config import HOST_MEMORY_SHARE, default_max_host_bytes
from hf_offload.engine.streams import SimulatedStreams


def stats(model):
    return hf_offload.activation_offloading_stats(model)


def pair(**options):
    plain = tiny_model()
    offloaded = twin(plain)
    enable_sim(offloaded, **options)
    return plain, offloaded


def checked_step(plain, offloaded, seed=1):
    """One step on both; asserts parity and that every saved tensor was counted exactly once."""
    before = stats(offloaded).total_pack_calls
    assert_same_step(plain, offloaded, batch(seed))
    s = stats(offloaded)
    assert s.total_pack_calls - before == s.offloaded_tensors + sum(s.kept_tensors.values())
    return s


def assert_nothing_held(model):
    collect()
    s = stats(model)
    assert (s.host_bytes_held, s.live_host_copies) == (0, 0)


def test_default_budget_is_a_share_of_available_memory_per_local_process(monkeypatch):
    monkeypatch.setattr("hf_offload.config.available_host_bytes", lambda: 100 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_max_host_bytes() == int(100 * 2**30 * HOST_MEMORY_SHARE) // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert default_max_host_bytes() == int(100 * 2**30 * HOST_MEMORY_SHARE)
    model = tiny_model()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model.enable_activation_offloading(simulate_on_cpu=True)
    assert stats(model).max_host_bytes == int(100 * 2**30 * HOST_MEMORY_SHARE) // 2


@pytest.mark.parametrize("budget_share", [0.0, 0.4])
def test_host_budget_keeps_the_rest_on_the_device(budget_share, caplog):
    unlimited = pair()[1]
    train_step(unlimited, batch())
    full = stats(unlimited).offloaded_bytes
    budget = int(full * budget_share)
    plain, offloaded = pair(max_host_bytes=budget)
    with caplog.at_level("WARNING", logger="hf_offload"):
        for seed in range(3):
            s = checked_step(plain, offloaded, seed)
            assert s.offloaded_bytes <= budget
            assert s.kept_tensors["over_budget"] > 0
            assert s.pool_bytes <= budget
    assert (s.offloaded_tensors > 0) == (budget_share > 0)
    warnings = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
    assert len(warnings) == 1 and f"max_host_bytes={budget}" in warnings[0]
    assert_nothing_held(offloaded)


def test_failed_host_allocation_keeps_the_tensor_on_the_device(monkeypatch, caplog):
    calls = {"n": 0}
    original = SimulatedStreams.host_buffer

    def every_third_fails(self, nbytes):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("CUDA error: out of memory (simulated pinned allocation failure)")
        return original(self, nbytes)

    monkeypatch.setattr(SimulatedStreams, "host_buffer", every_third_fails)
    plain, offloaded = pair()
    with caplog.at_level("WARNING", logger="hf_offload"):
        for seed in range(3):
            s = checked_step(plain, offloaded, seed)
    assert s.kept_tensors["no_host_memory"] > 0 or calls["n"] < 3
    assert sum("could not allocate" in r.getMessage() for r in caplog.records) == 1
    assert_nothing_held(offloaded)


def test_exception_in_backward_leaves_the_next_step_exact():
    plain, offloaded = pair()
    out = offloaded(input_ids=batch(), labels=batch())

    def fail(grad):
        raise RuntimeError("boom in backward")

    out.logits.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom in backward"):
        out.loss.backward()
    del out
    offloaded.zero_grad()
    assert_nothing_held(offloaded)
    checked_step(plain, offloaded)
    assert_nothing_held(offloaded)


def test_interrupt_between_forward_and_backward_then_continue():
    plain, offloaded = pair()
    with pytest.raises(KeyboardInterrupt):
        loss = loss_of(offloaded, batch())
        raise KeyboardInterrupt
    del loss
    assert_nothing_held(offloaded)
    checked_step(plain, offloaded)


def test_skipped_backward_then_continue():
    plain, offloaded = pair()
    for _ in range(2):
        loss_of(offloaded, batch())  # forward whose backward never happens
    assert_nothing_held(offloaded)
    checked_step(plain, offloaded)
    assert_nothing_held(offloaded)


def test_switching_off_and_on_between_steps():
    plain, offloaded = pair()
    checked_step(plain, offloaded, 1)
    offloaded.disable_activation_offloading()
    assert_same_step(plain, offloaded, batch(2))
    enable_sim(offloaded)
    s = checked_step(plain, offloaded, 3)
    assert s.offloaded_tensors > 0
    assert_nothing_held(offloaded)


def test_dtype_and_device_moves_after_enable():
    plain, offloaded = pair()
    for model in (plain, offloaded):
        model.to("cpu").to(torch.bfloat16)
    s = checked_step(plain, offloaded)
    assert s.offloaded_tensors > 0 and s.kept_tensors["parameter"] > 0
    assert_nothing_held(offloaded)


def test_enabling_in_eval_mode_is_logged_and_engages_when_training(caplog):
    plain, offloaded = tiny_model(), None
    offloaded = twin(plain)
    offloaded.eval()
    with caplog.at_level("INFO", logger="hf_offload"):
        enable_sim(offloaded)
    assert any("eval mode" in r.getMessage() for r in caplog.records)
    loss_of(offloaded, batch()).backward()
    assert stats(offloaded).total_layer_scopes == 0
    offloaded.train()
    offloaded.zero_grad()
    checked_step(plain, offloaded)
    assert stats(offloaded).offloaded_tensors > 0


def test_two_models_with_interleaved_forwards_keep_separate_state():
    policy_plain, policy = pair()
    reference_plain = tiny_model(seed=5)
    reference = twin(reference_plain)
    enable_sim(reference, keep_last_layers=0)
    ids = batch()
    results = {}
    for name, (a, b) in {"plain": (policy_plain, reference_plain), "offloaded": (policy, reference)}.items():
        a.zero_grad()
        b.zero_grad()
        loss_a = loss_of(a, ids)
        loss_b = loss_of(b, ids)  # interleaved: both graphs alive at once
        loss_b.backward()
        loss_a.backward()
        results[name] = (
            loss_a.detach(),
            loss_b.detach(),
            {
                **{f"a.{k}": p.grad for k, p in a.named_parameters()},
                **{f"b.{k}": p.grad for k, p in b.named_parameters()},
            },
        )
    assert torch.equal(results["plain"][0], results["offloaded"][0])
    assert torch.equal(results["plain"][1], results["offloaded"][1])
    assert_bit_identical(results["plain"][2], results["offloaded"][2])
    assert stats(policy).layers_offloaded == 2 and stats(reference).layers_offloaded == 3
    assert policy._hf_offload.engine is not reference._hf_offload.engine


def test_hundred_steps_flat_memory_and_identical_results():
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    plain, offloaded = pair()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, offloaded)]
    rss, pool = [], []
    for step in range(100):
        losses = []
        for model, optimizer in zip((plain, offloaded), optimizers, strict=True):
            loss = loss_of(model, batch(seed=step % 7))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(*losses), f"step {step}"
        rss.append(process.memory_info().rss)
        pool.append(stats(offloaded).pool_bytes)
    for p, q in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(set(pool[1:])) == 1, "the host pool kept growing"
    assert max(rss[20:]) - min(rss[20:]) < 16 * 2**20, "process memory grew"
    assert_nothing_held(offloaded)


def test_pool_reuses_buffers_across_varying_sequence_lengths():
    """Dynamic padding gives every step a different length; power-of-two buffers keep the pool
    from growing with each new length."""
    model = tiny_model()
    enable_sim(model)
    lengths = [16, 12, 9, 15, 11, 13, 10, 14]
    for seq in lengths:
        train_step(model, batch(seed=seq, seq=seq))
    first_round = stats(model)
    for seq in reversed(lengths):
        train_step(model, batch(seed=seq, seq=seq))
    second_round = stats(model)
    assert second_round.pool_allocations == first_round.pool_allocations
    assert second_round.pool_bytes == first_round.pool_bytes
    assert second_round.host_bytes_held == 0


def test_data_parallel_replicas_run_their_own_weights():
    model = tiny_model()
    enable_sim(model)
    layer = model.model.layers[0]
    train_step(model, batch())  # the slot has found where the layer's parameters are
    replica = layer._replicate_for_data_parallel()
    assert replica.forward.__self__ is replica, "a replica's forward must not run the original layer"
    assert replica._replicate_for_data_parallel().forward.__self__ is not layer
    # The replica's own slot, reading the replica's parameters (on another GPU, under DataParallel).
    slot, replica_slot = layer._hf_offload_layer, replica._hf_offload_layer
    assert replica_slot is not slot and replica_slot.controller is slot.controller
    assert replica_slot.position == slot.position
    replica_slot.device(replica, (), {})
    assert replica_slot._device_probe[0] in set(replica.modules())
    model.disable_activation_offloading()
    assert "_replicate_for_data_parallel" not in layer.__dict__


def test_a_layer_listed_twice_is_wrapped_once():
    hf_offload.register_adapter("qwen3", lambda model: [*model.model.layers, model.model.layers[0]])
    try:
        plain = tiny_model("qwen3")
        model = twin(plain)
        enable_sim(model)
        assert_same_step(plain, model, batch())
        assert stats(model).total_layer_scopes == 3
    finally:
        hf_offload.unregister_adapter("qwen3")
