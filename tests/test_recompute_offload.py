"""Inside a checkpointed layer's recompute, what is saved for the attention's backward waits on the
host while the MLP's backward runs, and comes back when the gradient of the attention's output
arrives (`hf_offload.engine.recompute`). Exact: bit-identical to the same step without offloading,
under the race checker's lazy copies; the companions show that a copy back made late, or not made,
or a storage brought back before the MLP's backward has run, is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import batch, enable_sim, tiny_model, train_step, twin
from peft import LoraConfig, get_peft_model

import hf_offload
from hf_offload.engine import ordering, recompute
from hf_offload.engine.offloader import ActivationOffloader
from hf_offload.engine.streams import simulated_schedule

pytestmark = pytest.mark.usefixtures("quiet_simulation")

LAYERS = 2
SETUPS = {
    "non_reentrant": dict(reentrant=False, tiled=False, lora=False),
    "reentrant": dict(reentrant=True, tiled=False, lora=False),
    "non_reentrant_tiled": dict(reentrant=False, tiled=True, lora=False),
    "reentrant_tiled": dict(reentrant=True, tiled=True, lora=False),
    "lora_non_reentrant_tiled": dict(reentrant=False, tiled=True, lora=True),
    "lora_reentrant": dict(reentrant=True, tiled=False, lora=True),
}


def lora(model):
    torch.manual_seed(3)
    # init_lora_weights=False: B starts random, so every adapter gradient is non-zero.
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def build(reentrant: bool, tiled: bool, lora: bool):
    plain = tiny_model("llama", num_hidden_layers=LAYERS)
    plain.activation_checkpointing_enable({"use_reentrant": reentrant})
    if tiled:
        hf_offload.enable_sequence_tiling(plain, tile_tokens=4, loss=False)
    model = twin(plain)
    enable_sim(model)
    if lora:
        plain, model = globals()["lora"](plain), globals()["lora"](model)
    return plain, model


def layers_of(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def identical(plain, model) -> bool:
    expected_loss, expected = train_step(plain, batch())
    loss, actual = train_step(model, batch())
    return torch.equal(expected_loss, loss) and all(torch.equal(expected[k], actual[k]) for k in expected)


def spy_events(model, monkeypatch) -> list:
    """("parked", layer, storages), ("mlp done", layer) when the gradient of the MLP's input arrives,
    ("restored", layer, sizes the storages had then, storages), in order."""
    events = []
    park, unpark = recompute.park, recompute.unpark

    def parking(group, storages):
        parked = park(group, storages)
        events.append(("parked", group.position, [entry.storage for entry in parked]))
        return parked

    def unparking(group, parked):
        storages = [entry.storage for entry in parked]
        events.append(("restored", group.position, [storage.nbytes() for storage in storages], storages))
        return unpark(group, parked)

    monkeypatch.setattr(recompute, "park", parking)
    monkeypatch.setattr(recompute, "unpark", unparking)

    def mlp_input(module, args, index):
        hidden = args[0]
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: events.append(("mlp done", index)))

    for index, layer in enumerate(layers_of(model)):
        layer.mlp.register_forward_pre_hook(lambda m, a, index=index: mlp_input(m, a, index))
    return events


def waited_through_the_mlp_backward(events) -> bool:
    """Every layer parked storages in its recompute; each was freed (0 bytes) until its layer's MLP
    backward was done, and brought back after that, once."""
    for layer in range(LAYERS):
        parked = [i for i, event in enumerate(events) if event[:2] == ("parked", layer)]
        done = [i for i, event in enumerate(events) if event == ("mlp done", layer)]
        restored = [i for i, event in enumerate(events) if event[:2] == ("restored", layer)]
        if len(parked) != 1 or len(restored) != 1 or not done or not events[parked[0]][2]:
            return False
        if not parked[0] < done[-1] < restored[0] or any(events[restored[0]][2]):
            return False
    return True


@pytest.fixture
def everything_moves(monkeypatch):
    monkeypatch.setattr(recompute, "RECOMPUTE_OFFLOAD_BYTES", 0)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_the_attention_s_saved_tensors_wait_on_the_host_exactly(setup, everything_moves, monkeypatch):
    with simulated_schedule("lazy"):
        plain, model = build(**SETUPS[setup])
        events = spy_events(model, monkeypatch)
        assert identical(plain, model)
    assert waited_through_the_mlp_backward(events), events
    stats = hf_offload.activation_offloading_stats(model)
    parked = [storage for event in events if event[0] == "parked" for storage in event[2]]
    assert stats.recompute_offloaded_tensors == stats.recompute_restored_tensors == len(parked) > 0
    assert stats.live_host_copies == 0 and stats.host_bytes_held == 0  # nothing outlives the step's graph
    # Back at full size once the step is over; what is counted is what moved.
    assert stats.recompute_offloaded_bytes == sum(storage.nbytes() for storage in parked)
    # Nothing the MLP's backward reads moved: no parked storage is one of its intermediates.
    tokens = batch().numel()
    intermediate = tokens * model.config.intermediate_size * 4
    assert all(storage.nbytes() not in (intermediate, intermediate // tokens * 4) for storage in parked)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_copy_back_the_attention_does_not_wait_for_is_caught(setup, everything_moves, monkeypatch):
    """Companion: without the wait before the attention's backward reads what came back, the lazy
    copies have not run, and it reads garbage."""
    monkeypatch.setattr(ordering, "before_using_recomputed", lambda *args: None)
    with simulated_schedule("lazy"):
        plain, model = build(**SETUPS[setup])
        assert not identical(plain, model)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_storage_grown_back_without_its_bytes_is_caught(setup, everything_moves, monkeypatch):
    """Companion: the storages get device memory again, but the copies back are never made."""

    def regrow_only(group, parked):
        for entry in parked:
            group.device.streams.regrow(entry.storage, entry.nbytes)
        return len(parked)

    monkeypatch.setattr(recompute, "unpark", regrow_only)
    plain, model = build(**SETUPS[setup])
    assert not identical(plain, model)


def test_a_storage_brought_back_before_the_mlp_backward_is_caught(everything_moves, monkeypatch):
    """Companion of the order check: brought back as soon as parked, the step is still exact, but
    nothing waited on the host through the MLP's backward."""
    park_recomputed = ActivationOffloader.park_recomputed

    def parking_and_restoring(self, scope, keep=None):
        park_recomputed(self, scope, keep)
        self.restore_recomputed(scope.group)

    monkeypatch.setattr(ActivationOffloader, "park_recomputed", parking_and_restoring)
    plain, model = build(**SETUPS["non_reentrant_tiled"])
    events = spy_events(model, monkeypatch)
    assert identical(plain, model)
    assert not waited_through_the_mlp_backward(events)


def test_short_sequences_keep_what_the_recompute_saves_on_the_device(monkeypatch):
    """Below RECOMPUTE_OFFLOAD_BYTES per layer (the default, at this size) nothing moves in the recompute."""
    plain, model = build(**SETUPS["non_reentrant_tiled"])
    events = spy_events(model, monkeypatch)
    assert identical(plain, model)
    stats = hf_offload.activation_offloading_stats(model)
    assert stats.recompute_offloaded_tensors == stats.recompute_restored_tensors == 0
    assert stats.recompute_kept_bytes > 0
    assert events and all(event[0] == "mlp done" for event in events)


def test_disabling_gives_the_layers_their_checkpointing_function_back():
    _plain, model = build(**SETUPS["non_reentrant"])
    originals = [layer._gradient_checkpointing_func for layer in layers_of(model)]
    train_step(model, batch())
    wrapped = [layer._gradient_checkpointing_func for layer in layers_of(model)]
    assert all(now is not before for now, before in zip(wrapped, originals, strict=True))
    hf_offload.disable_activation_offloading(model)
    for layer, original in zip(layers_of(model), originals, strict=True):
        assert layer._gradient_checkpointing_func is original
        assert not layer.self_attn._forward_hooks
        assert not layer.mlp._forward_pre_hooks and not layer.post_attention_layernorm._forward_pre_hooks


def test_the_simulator_moves_what_the_engine_moves_inside_the_recompute(monkeypatch):
    """`hf-offload estimate` runs the engine on the meta device: the same storages move in the
    recompute as on real tensors, and its tracker sees them leave the device."""
    from hf_offload.engine import offloader
    from hf_offload.tools.simulator import Simulator, Training

    monkeypatch.setattr(recompute, "RECOMPUTE_OFFLOAD_BYTES", 0)
    monkeypatch.setattr(offloader, "EARLY_RELEASE_BYTES", 0)
    config = dict(vocab_size=64, intermediate_size=256, max_position_embeddings=2048, num_hidden_layers=LAYERS)
    tokens = 1024
    # Eager attention: no kernel whose CPU and CUDA versions save different tensors.
    config["attn_implementation"] = "eager"
    training = Training(dtype=torch.float32, tile_tokens=128, min_offload_bytes=0)
    simulator = Simulator(tiny_model(**config).config, training)
    parked = simulator.run("checkpointing+hf_offload+tiled", tokens)
    model = tiny_model(**config)
    model.activation_checkpointing_enable()
    hf_offload.enable_sequence_tiling(model, tile_tokens=128)
    hf_offload.enable_activation_offloading(model, simulate_on_cpu=True, min_offload_bytes=0)
    ids = torch.randint(64, (1, tokens))
    model(input_ids=ids, labels=ids).loss.backward()
    real = hf_offload.activation_offloading_stats(model)
    assert parked.offload_stats["recompute_offloaded_bytes"] == real.recompute_offloaded_bytes > 0
    assert parked.offload_stats["recompute_offloaded_tensors"] == real.recompute_offloaded_tensors
    assert parked.offload_stats["early_releases"] == real.early_releases > 0
    # A setup simulated as systems without it run (ALST's, in benchmarks/published.py).
    without = Simulator(simulator.config, dataclasses.replace(training, recompute_offload=False, early_release=False))
    stats = without.run("checkpointing+hf_offload+tiled", tokens).offload_stats
    assert stats["recompute_offloaded_bytes"] == 0 and stats["early_releases"] == 0
    monkeypatch.setattr(recompute, "RECOMPUTE_OFFLOAD_BYTES", 2**62)
    kept = simulator.run("checkpointing+hf_offload+tiled", tokens)
    assert kept.offload_stats["recompute_offloaded_bytes"] == 0
    # While each layer's MLP runs its backward, less is on the device (here attention's own
    # backward, eager's score matrices back, holds the step's peak).
    mlp = [tag for tag in kept.tag_peaks if tag[0] == "backward" and str(tag[-1]).endswith("mlp")]
    assert mlp and all(parked.tag_peaks[tag] < kept.tag_peaks[tag] for tag in mlp), (mlp, kept.tag_peaks)


def spy_later_parts(model, events: list) -> None:
    """("part", layer) when a layer's post-attention norm or MLP (Phi: no such norm) starts in backward:
    only its checkpoint's recompute calls it then (tiling's slices in backward do not call the module)."""
    from hf_offload.engine import in_backward

    def note(index: int) -> None:
        if in_backward():
            events.append(("part", index))

    for index, layer in enumerate(layers_of(model)):
        part = getattr(layer, "post_attention_layernorm", None) or layer.mlp
        part.register_forward_pre_hook(lambda module, args, index=index: note(index))


def parked_before_the_later_parts(events) -> bool:
    """Every layer parked before its recompute ran the first part after the attention block."""
    for layer in range(LAYERS):
        parked = [i for i, event in enumerate(events) if event[:2] == ("parked", layer)]
        part = [i for i, event in enumerate(events) if event == ("part", layer)]
        if len(parked) != 1 or not part or not parked[0] < part[0]:
            return False
    return True


@pytest.mark.parametrize("setup", ["non_reentrant_tiled", "reentrant", "lora_non_reentrant_tiled"])
def test_the_attention_s_tensors_leave_before_the_post_attention_parts_run(setup, everything_moves, monkeypatch):
    """In the recompute, what was saved for the attention leaves before the post-attention norm runs
    (with tiling the norm's and the MLP's forwards run whole in the recompute: the peak of a long
    sequence), not when the recompute ends; exact still."""
    with simulated_schedule("lazy"):
        plain, model = build(**SETUPS[setup])
        events = spy_events(model, monkeypatch)
        spy_later_parts(model, events)
        assert identical(plain, model)
    assert parked_before_the_later_parts(events), events
    assert waited_through_the_mlp_backward(events), events


def test_parking_when_the_recompute_ends_is_caught(everything_moves, monkeypatch):
    """Companion: parked only when the recompute ends, after its norm and MLP ran with everything on
    the device, the step is exact and the order check fails."""
    park_recomputed = ActivationOffloader.park_recomputed

    def at_the_end_only(self, scope, keep=None):
        if keep is None:
            park_recomputed(self, scope)

    monkeypatch.setattr(ActivationOffloader, "park_recomputed", at_the_end_only)
    plain, model = build(**SETUPS["non_reentrant_tiled"])
    events = spy_events(model, monkeypatch)
    spy_later_parts(model, events)
    assert identical(plain, model)
    assert waited_through_the_mlp_backward(events)
    assert not parked_before_the_later_parts(events)


def read_while_parked(events) -> bool:
    """Whether a ("read", storage) event found its storage parked (parked, not yet restored)."""
    where = {}
    for event in events:
        if event[0] in ("parked", "restored"):
            for storage in event[-1] if event[0] == "parked" else event[3]:
                where[id(storage)] = event[0]
        elif event[0] == "read" and where.get(id(event[1])) == "parked":
            return True
    return False


def phi_step(monkeypatch) -> tuple[bool, list]:
    """A Phi model (attention and MLP in parallel: the MLP takes the input norm's output, which the
    q/k/v projections saved before the attention returned, so it is parked with them). Parked
    storages are copied out but not freed, so that a storage read while parked shows in the events
    instead of as a crash. Returns whether the step was exact, and the events."""
    from hf_offload.engine import in_backward
    from hf_offload.engine.streams import SimulatedStreams

    monkeypatch.setattr(SimulatedStreams, "shrink", lambda self, storage: None)
    monkeypatch.setattr(SimulatedStreams, "regrow", lambda self, storage, nbytes: None)
    plain = tiny_model("phi", num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=128)  # fmt: skip
    plain.activation_checkpointing_enable({"use_reentrant": False})
    model = twin(plain)
    enable_sim(model)
    events = spy_events(model, monkeypatch)

    def note(module, args) -> None:
        if in_backward():
            events.append(("read", args[0].untyped_storage()))

    for layer in layers_of(model):
        layer.mlp.register_forward_pre_hook(note)
    exact = identical(plain, model)
    assert any(event[0] == "parked" and event[2] for event in events)
    assert any(event[0] == "read" for event in events)
    return exact, events


def test_what_a_parallel_mlp_reads_comes_back_before_it_runs(everything_moves, monkeypatch):
    exact, events = phi_step(monkeypatch)
    assert exact and not read_while_parked(events)


def test_a_parked_argument_of_the_mlp_is_caught(everything_moves, monkeypatch):
    """Companion: without bringing back what the MLP is called with, it reads a parked storage."""
    monkeypatch.setattr(ActivationOffloader, "restore_read", lambda self, group, tensors: None)
    _exact, events = phi_step(monkeypatch)
    assert read_while_parked(events)


def release_events(model, monkeypatch) -> list:
    """("released", layer of the batch) when a batch of copies to the host lets go of its sources,
    ("attention", layer) when a layer's attention starts in forward (after ours, at its q_proj)."""
    from hf_offload.engine import in_backward
    from hf_offload.engine.offloader import DeviceContext

    events = []
    release = DeviceContext.release

    def releasing(self, batch):
        events.append(("released", batch.nbytes))
        return release(self, batch)

    monkeypatch.setattr(DeviceContext, "release", releasing)

    def note(index: int) -> None:
        if not in_backward():
            events.append(("attention", index))

    for index, layer in enumerate(layers_of(model)):
        layer.self_attn.q_proj.register_forward_hook(lambda module, args, output, index=index: note(index))
    return events


def released_before_the_next_attention(events) -> bool:
    """Layer 0's copies (the only earlier batch when layer 1 runs) let go before layer 1's attention."""
    released = [i for i, event in enumerate(events) if event[0] == "released"]
    attention = [i for i, event in enumerate(events) if event == ("attention", 1)]
    return bool(released and attention) and released[0] < attention[0]


@pytest.mark.parametrize("schedule", ["lazy", "random"])
@pytest.mark.parametrize("setup", ["non_reentrant_tiled", "reentrant"])
def test_the_copies_of_earlier_layers_let_go_before_the_attention(setup, schedule, monkeypatch):
    """At long context (EARLY_RELEASE_BYTES, lowered here) a layer's copies to the host release their
    device sources before the next layer's attention, its forward's peak; exact under the race checker."""
    from hf_offload.engine import offloader

    monkeypatch.setattr(offloader, "EARLY_RELEASE_BYTES", 0)
    with simulated_schedule(schedule, seed=5):
        plain, model = build(**SETUPS[setup])
        events = release_events(model, monkeypatch)
        assert identical(plain, model)
    assert released_before_the_next_attention(events), events
    assert hf_offload.activation_offloading_stats(model).early_releases > 0


def test_copies_let_go_at_the_layer_end_are_caught(monkeypatch):
    """Companion of the order check: below EARLY_RELEASE_BYTES (the default, at this size) the sources
    go at the next layer's end, after its attention."""
    plain, model = build(**SETUPS["non_reentrant_tiled"])
    events = release_events(model, monkeypatch)
    assert identical(plain, model)
    assert not released_before_the_next_attention(events)
    assert hf_offload.activation_offloading_stats(model).early_releases == 0


def test_an_early_release_without_waiting_for_its_copy_is_caught(monkeypatch):
    """Companion: released before the attention without waiting for the copy out, the lazy copy reads
    a source already let go of."""
    from hf_offload.engine import offloader

    monkeypatch.setattr(offloader, "EARLY_RELEASE_BYTES", 0)
    monkeypatch.setattr(ordering, "before_releasing_sources", lambda *args: None)
    with simulated_schedule("lazy"):
        plain, model = build(**SETUPS["non_reentrant_tiled"])
        assert not identical(plain, model)


def held_peak(monkeypatch) -> list[int]:
    """[the most host memory the budgets held at once], updated as the step charges them."""
    from hf_offload.engine.pool import HostBudget

    peak, charge = [0], HostBudget.charge

    def charging(self, nbytes):
        charge(self, nbytes)
        peak[0] = max(peak[0], self.held)

    monkeypatch.setattr(HostBudget, "charge", charging)
    return peak


def step_within_a_budget_the_inputs_fill(monkeypatch):
    """max_host_bytes set to what the checkpoint inputs alone hold at most; then a step with parking
    on. Returns (whether it was exact, the held peak, the limit, the storages parked)."""
    plain, model = build(reentrant=False, tiled=True, lora=False)
    monkeypatch.setattr(recompute, "RECOMPUTE_OFFLOAD_BYTES", 2**62)
    peak = held_peak(monkeypatch)
    train_step(model, batch())
    limit = peak[0]
    plain, model = build(reentrant=False, tiled=True, lora=False)
    hf_offload.enable_activation_offloading(model, simulate_on_cpu=True, min_offload_bytes=0, max_host_bytes=limit)
    monkeypatch.setattr(recompute, "RECOMPUTE_OFFLOAD_BYTES", 0)
    peak[0] = 0
    events = spy_events(model, monkeypatch)
    exact = identical(plain, model)
    parked = [storage for event in events if event[0] == "parked" for storage in event[2]]
    return exact, peak[0], limit, parked


def test_what_the_recompute_parks_stays_within_max_host_bytes(monkeypatch):
    """Parked storages are charged to max_host_bytes like the checkpoint inputs: with a budget the
    inputs already fill, the recompute keeps its tensors on the device, and the step is exact."""
    exact, held, limit, _ = step_within_a_budget_the_inputs_fill(monkeypatch)
    assert exact
    assert 0 < held <= limit


def test_parking_past_max_host_bytes_is_caught(monkeypatch):
    """Companion: parking without asking the budget holds more host memory than max_host_bytes."""
    monkeypatch.setattr(recompute, "_room_for", lambda pool, nbytes: True)
    exact, held, limit, parked = step_within_a_budget_the_inputs_fill(monkeypatch)
    assert parked and held > limit
