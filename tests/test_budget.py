"""The device-memory budget (`max_device_bytes`): the planner on its own, then the engine on the
CPU simulation, whose byte accounting is the same as on a GPU: parity for every budget, the
peak it reports never above a budget that full offloading fits, the fewest layers offloaded,
a new plan for every step length, and "auto"."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from conftest import assert_same_step, batch, enable_sim, tiny_model, train_step, twin
from test_races import identical_steps, simulated_streams
from transformers import AutoConfig

import hf_offload
from hf_offload import api, auto_budget
from hf_offload.engine.planner import plan, resident_peak
from hf_offload.engine.streams import simulated_schedule

LAYERS = 6


def replayed_peak(layer_bytes, offloaded, prefetch, restore_bytes=None):
    """The engine's accounting, written out event by event as plainly as possible."""
    restore_bytes = restore_bytes or layer_bytes
    kept = [i >= offloaded for i in range(len(layer_bytes))]
    peak, resident = 0, 0
    for j, nbytes in enumerate(layer_bytes):
        resident += nbytes if kept[j] else 0
        in_flight = (0 if kept[j] else nbytes) + (layer_bytes[j - 1] if j > 0 and not kept[j - 1] else 0)
        peak = max(peak, resident + in_flight)
    for g in reversed(range(len(layer_bytes))):
        ahead = sum(restore_bytes[i] for i in range(max(g - prefetch, 0), g + 1) if not kept[i])
        peak = max(peak, resident + ahead)
        resident -= layer_bytes[g] if kept[g] else 0
    return peak


def test_resident_peak_replays_the_accounting():
    generator = random.Random(0)
    for _ in range(2000):
        count = generator.randint(1, 8)
        layer_bytes = [generator.randint(0, 9) for _ in range(count)]
        restore_bytes = [b + generator.randint(0, 3) for b in layer_bytes]
        offloaded, prefetch = generator.randint(0, count), generator.randint(0, 3)
        expected = replayed_peak(layer_bytes, offloaded, prefetch, restore_bytes)
        assert resident_peak(layer_bytes, offloaded, prefetch, restore_bytes) == expected


def test_plan_offloads_the_fewest_leading_layers_that_fit():
    generator = random.Random(1)
    for _ in range(2000):
        count = generator.randint(1, 8)
        layer_bytes = [generator.randint(1, 9) for _ in range(count)]
        offloadable, prefetch = generator.randint(0, count), generator.randint(0, 2)
        budget = generator.randint(0, sum(layer_bytes) + 5)
        chosen = plan(layer_bytes, budget, offloadable_layers=offloadable, prefetch_layers=prefetch)
        fitting = [k for k in range(offloadable + 1) if resident_peak(layer_bytes, k, prefetch) <= budget]
        if fitting:
            assert (chosen.offloaded_layers, chosen.fits) == (fitting[0], True)
            assert chosen.predicted_peak_bytes <= budget
        else:  # nothing fits: everything offloadable goes, as without a budget
            assert (chosen.offloaded_layers, chosen.fits) == (offloadable, False)


def budget_model(budget, **options):
    plain = tiny_model(num_hidden_layers=LAYERS)
    offloaded = twin(plain)
    enable_sim(offloaded, max_device_bytes=budget, **options)
    return plain, offloaded


def measured_layer_bytes(seq=12):
    """Each layer call's activation bytes (kept or offloaded) at `seq` tokens, as the engine
    measured them in a first step (which offloads every layer)."""
    plain, offloaded = budget_model(10**12)
    assert_same_step(plain, offloaded, batch(seq=seq))
    stats = offloaded.activation_offloading_stats()
    assert stats.layers_offloaded == LAYERS - 1 and stats.planned_peak_bytes is None  # measuring
    layers = offloaded._hf_offload.engine._pass_layers
    return [own for own, _, _ in layers], [own if restored is None else restored for own, restored, _ in layers]


def full_offload_peak(layer_bytes, restore_bytes):
    return resident_peak(layer_bytes, LAYERS - 1, 1, restore_bytes)


@pytest.mark.parametrize("share", [0.0, 0.5, 2.0])
def test_every_budget_is_exact(share):
    """Budgets of 0, half the unoffloaded bytes and more than all of them: losses and gradients
    bit-identical to training without offloading, step after step."""
    layer_bytes, _ = measured_layer_bytes()
    plain, offloaded = budget_model(int(share * sum(layer_bytes)))
    for seed in range(3):
        assert_same_step(plain, offloaded, batch(seed=seed))
    stats = offloaded.activation_offloading_stats()
    if share == 0.0:
        assert stats.layers_kept_for_budget == 0  # nothing fits: every layer is offloaded
    elif share == 2.0:
        assert stats.layers_offloaded == 0 and stats.layers_kept_for_budget == LAYERS - 1
    else:
        assert 0 < stats.layers_offloaded < LAYERS - 1
    assert stats.host_bytes_held == 0 and stats.live_host_copies == 0


@pytest.mark.parametrize("schedule", ["lazy", "random"])
@pytest.mark.parametrize("share", [0.0, 0.5, 2.0])
def test_every_budget_is_exact_under_the_race_checker(schedule, share):
    layer_bytes, _ = measured_layer_bytes()
    with simulated_schedule(schedule, seed=3):
        plain, offloaded = budget_model(int(share * sum(layer_bytes)))
        assert identical_steps(plain, offloaded, steps=3)
    assert simulated_streams(offloaded).violations == []


def test_the_plan_is_the_fewest_layers_that_fit_and_the_peak_stays_under_the_budget():
    layer_bytes, restore_bytes = measured_layer_bytes()
    unoffloaded = sum(layer_bytes)
    floor = full_offload_peak(layer_bytes, restore_bytes)
    seen = set()
    for percent in range(10, 101, 10):
        budget = unoffloaded * percent // 100
        plain, offloaded = budget_model(budget)
        for seed in range(2):  # the first step measures, the second follows the plan
            assert_same_step(plain, offloaded, batch(seed=seed))
        stats = offloaded.activation_offloading_stats()
        fitting = [k for k in range(LAYERS) if resident_peak(layer_bytes, k, 1, restore_bytes) <= budget]
        expected = fitting[0] if fitting else LAYERS - 1
        assert stats.layers_offloaded == expected, percent
        assert stats.layers_offloaded + stats.layers_kept_for_budget == LAYERS - 1
        assert stats.max_device_bytes == budget
        # The engine's own accounting agrees with the plan's prediction...
        assert stats.peak_resident_bytes <= stats.planned_peak_bytes
        if budget >= floor:
            # ...so a budget that full offloading fits is never exceeded.
            assert stats.peak_resident_bytes <= budget, percent
        seen.add(stats.layers_offloaded)
    assert len(seen) >= 3, "the budgets should have produced different plans"


def test_the_accounting_matches_the_plan_exactly_without_shared_copies():
    """With min_offload_bytes above the rotary cos/sin (the only storages several layers save),
    every layer brings back only its own copies, and the measured peak is the predicted one."""
    plain = tiny_model(num_hidden_layers=LAYERS)
    offloaded = twin(plain)
    options = dict(min_offload_bytes=BATCH_SEQ_COS_SIN_BYTES + 1)
    enable_sim(offloaded, max_device_bytes=10**12, **options)
    assert_same_step(plain, offloaded, batch())
    layer_bytes = [own for own, _, _ in offloaded._hf_offload.engine._pass_layers]
    assert all(layer_bytes)
    for offloaded_layers in range(1, LAYERS):
        budget = resident_peak(layer_bytes, offloaded_layers, 1)
        enable_sim(offloaded, max_device_bytes=budget, **options)
        for seed in range(2):
            assert_same_step(plain, offloaded, batch(seed=seed))
        stats = offloaded.activation_offloading_stats()
        assert stats.layers_offloaded <= offloaded_layers
        assert stats.peak_resident_bytes == stats.planned_peak_bytes <= budget


# The tiny model's rotary cos/sin: batch x seq x head_dim float32 each (conftest: head_dim 8).
BATCH_SEQ_COS_SIN_BYTES = 2 * 12 * 8 * 4


def test_a_new_plan_for_every_step_length():
    layer_bytes, _ = measured_layer_bytes(seq=12)
    plain, offloaded = budget_model(sum(layer_bytes) // 2)
    lengths = [12, 24, 6, 24, 12]
    plans = []
    for seed, seq in enumerate(lengths):
        assert_same_step(plain, offloaded, batch(seed=seed, seq=seq))
        stats = offloaded.activation_offloading_stats()
        plans.append((stats.plan_tokens, stats.layers_offloaded))
    assert [tokens for tokens, _ in plans[1:]] == [2 * seq for seq in lengths[1:]]
    by_length = dict(zip(lengths[1:], [offloaded for _, offloaded in plans[1:]], strict=True))
    assert by_length[24] > by_length[12] > by_length[6]  # longer steps offload more layers


def test_a_step_the_budget_cannot_hold_offloads_everything_with_one_warning(caplog):
    plain, offloaded = budget_model(1)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in range(3):
            assert_same_step(plain, offloaded, batch(seed=seed))
    warnings = [r.getMessage() for r in caplog.records if "max_device_bytes" in r.getMessage()]
    assert len(warnings) == 1 and "offloads every layer" in warnings[0]
    stats = offloaded.activation_offloading_stats()
    assert stats.layers_offloaded == LAYERS - 1 and stats.layers_kept_for_budget == 0


def test_no_budget_keeps_todays_behaviour():
    plain = tiny_model(num_hidden_layers=LAYERS)
    offloaded = twin(plain)
    enable_sim(offloaded)
    for seed in range(2):
        assert_same_step(plain, offloaded, batch(seed=seed))
    stats = offloaded.activation_offloading_stats()
    assert stats.max_device_bytes is None and stats.layers_kept_for_budget == 0
    assert stats.layers_offloaded == LAYERS - 1 and stats.peak_resident_bytes > 0
    assert "budget" not in stats.summary()


def test_summary_prints_the_plan():
    layer_bytes, _ = measured_layer_bytes()
    plain, offloaded = budget_model(sum(layer_bytes) // 2)
    summary = offloaded.activation_offloading_stats().summary()
    assert "device-memory budget" not in summary  # no step yet: nothing planned
    for seed in range(2):
        assert_same_step(plain, offloaded, batch(seed=seed))
    stats = offloaded.activation_offloading_stats()
    summary = stats.summary()
    assert f"offloaded the first {stats.layers_offloaded} of {LAYERS - 1}" in summary
    assert f"kept {stats.layers_kept_for_budget} on the device" in summary
    assert "for 24 tokens" in summary


@pytest.mark.parametrize(
    "value,error,match",
    [
        (-1, ValueError, "max_device_bytes must be an int >= 0, 'auto' or None, got -1"),
        ("half", ValueError, "max_device_bytes must be an int >= 0, 'auto' or None, got 'half'"),
        (1.5, TypeError, "max_device_bytes must be an int >= 0, 'auto' or None, got 1.5"),
        (True, TypeError, "max_device_bytes must be an int >= 0, 'auto' or None, got True"),
    ],
)
def test_bad_budgets_are_refused_with_the_valid_values(value, error, match):
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
        hf_offload.enable_activation_offloading(tiny_model(), max_device_bytes=value)


def test_auto_needs_an_accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    model = tiny_model()
    with pytest.raises(ValueError, match="max_device_bytes='auto' reads the accelerator's free memory"):
        hf_offload.enable_activation_offloading(model, max_device_bytes="auto")
    assert not model.is_activation_offloading  # refused before anything changed


@pytest.fixture
def fake_device_memory(monkeypatch):
    """An accelerator whose free memory the test sets; the engine runs in CPU simulation."""
    memory = {"free": 0, "total": 10**9, "reads": 0}

    def device_memory(device):
        memory["reads"] += 1
        return memory["free"], memory["total"]

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(auto_budget, "device_memory", device_memory)
    return memory


def test_auto_reads_free_memory_every_step_and_leaves_the_stated_reserve(fake_device_memory):
    plain = tiny_model(num_hidden_layers=LAYERS)
    offloaded = twin(plain)
    enable_sim(offloaded, max_device_bytes="auto")
    assert fake_device_memory["reads"] == 0  # enabling asks nothing of the device (no CUDA context there)
    controller = offloaded._hf_offload
    # Each step starts with no gradients (zero_grad(set_to_none=True)): backward allocates them all.
    gradients = sum(p.numel() * p.element_size() for p in offloaded.parameters() if p.requires_grad)
    predicted = api._predicted_step_bytes(controller, batch().numel())
    assert predicted > 0
    for seed, free in enumerate([5 * 10**8, 10**8]):
        fake_device_memory["free"] = free
        reserve = int(fake_device_memory["total"] * auto_budget.AUTO_BUDGET_MARGIN_SHARE) + gradients + predicted
        assert_same_step(plain, offloaded, batch(seed=seed))
        assert offloaded.activation_offloading_stats().max_device_bytes == free - reserve
    assert fake_device_memory["reads"] == 2  # once per step, at its first layer


def test_auto_that_cannot_read_memory_mid_training_offloads_everything(fake_device_memory, monkeypatch, caplog):
    plain = tiny_model(num_hidden_layers=LAYERS)
    offloaded = twin(plain)
    enable_sim(offloaded, max_device_bytes="auto")

    def unreadable(device):
        raise RuntimeError("no memory information for this device")

    monkeypatch.setattr(auto_budget, "device_memory", unreadable)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in range(2):
            assert_same_step(plain, offloaded, batch(seed=seed))
    assert any("cannot read the free memory" in r.getMessage() for r in caplog.records)
    stats = offloaded.activation_offloading_stats()
    assert stats.max_device_bytes == 0 and stats.layers_offloaded == LAYERS - 1


def test_checkpointing_plans_over_the_checkpoint_inputs():
    plain = tiny_model(num_hidden_layers=LAYERS)
    offloaded = twin(plain)
    for model in (plain, offloaded):
        model.activation_checkpointing_enable()
    hidden_bytes = batch().numel() * plain.config.hidden_size * 4  # one float32 layer input
    # Room for three checkpoint inputs: kept layers from the end, the rest offloaded.
    enable_sim(offloaded, max_device_bytes=3 * hidden_bytes)
    for seed in range(2):
        assert_same_step(plain, offloaded, batch(seed=seed))
    stats = offloaded.activation_offloading_stats()
    assert stats.layers_kept_for_budget + 1 == 3  # the kept last layer is one of the three
    assert stats.offloaded_tensors == stats.layers_offloaded == LAYERS - 3
    assert stats.peak_resident_bytes <= 3 * hidden_bytes


def test_the_earliest_layers_are_offloaded_and_the_last_ones_kept(monkeypatch):
    """Their copies have the most compute to hide behind; the last layers are needed first in
    backward."""
    from hf_offload.engine.offloader import ActivationOffloader

    layer_bytes, _ = measured_layer_bytes()
    plain, offloaded = budget_model(sum(layer_bytes) // 2)
    assert_same_step(plain, offloaded, batch(seed=0))
    groups = []
    enter = ActivationOffloader.enter_layer

    def recording_enter(self, **arguments):
        group = enter(self, **arguments)
        groups.append((group.position, group.keep, group.kept_reason))
        return group

    monkeypatch.setattr(ActivationOffloader, "enter_layer", recording_enter)
    assert_same_step(plain, offloaded, batch(seed=1))
    offloaded_count = offloaded.activation_offloading_stats().layers_offloaded
    assert 0 < offloaded_count < LAYERS - 1
    assert groups == (
        [(i, False, "kept_layer") for i in range(offloaded_count)]
        + [(i, True, "kept_for_budget") for i in range(offloaded_count, LAYERS - 1)]
        + [(LAYERS - 1, True, "kept_layer")]
    )


def test_auto_reserves_less_for_a_fused_loss_head():
    """Under Liger's fused linear cross-entropy the full logits never exist: "auto" reserves the
    larger of the fused head's bytes (auto_budget.loss_head_bytes_per_token(fused=True)) and one
    layer's activations, not 12 x vocab. (A vocabulary of 4096 makes the standard head the larger.)"""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from test_liger import transformers_restored

    model = tiny_model(num_hidden_layers=LAYERS, vocab_size=4096)
    enable_sim(model)
    controller = model._hf_offload
    tokens = batch().numel()
    shape = auto_budget.LayerShape.from_config(model.config)
    standard = api._predicted_step_bytes(controller, tokens)
    with transformers_restored():
        apply_liger_kernel_to_llama(
            model=model, rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True
        )
        fused = api._predicted_step_bytes(controller, tokens)
    layer = auto_budget.layer_bytes_per_token(shape, dtype_bytes=4)
    head = auto_budget.loss_head_bytes_per_token(shape, dtype_bytes=4)
    fused_head = auto_budget.loss_head_bytes_per_token(shape, dtype_bytes=4, fused=True)
    assert head > layer  # what the vocabulary was chosen for
    assert standard == tokens * head
    assert fused == tokens * max(layer, fused_head) < standard


def test_several_forwards_before_one_backward_share_the_budget():
    """Two forwards before one backward (gradient accumulation by summing losses): the second is
    planned with what the first left on the device, even when the first kept every layer."""
    from conftest import loss_of

    layer_bytes, restore_bytes = measured_layer_bytes()
    one_forward = sum(layer_bytes)
    # Room for one forward's activations plus what a fully offloaded one needs: not for two.
    budget = one_forward + full_offload_peak(layer_bytes, restore_bytes) + 1024
    plain, offloaded = budget_model(budget)
    for seeds in ((2, 3), (4, 5)):  # the measuring step, then the planned one
        for model in (plain, offloaded):
            model.zero_grad(set_to_none=True)
            (loss_of(model, batch(seed=seeds[0])) + loss_of(model, batch(seed=seeds[1]))).backward()
        assert_bit_identical_grads(plain, offloaded)
    stats = offloaded.activation_offloading_stats()
    assert stats.layers_kept_for_budget >= LAYERS - 1  # the first forward kept every layer...
    assert stats.layers_offloaded > 0  # ...and the second had to offload
    assert stats.peak_resident_bytes <= budget


def assert_bit_identical_grads(plain, offloaded):
    from conftest import assert_bit_identical, grads

    assert_bit_identical(grads(plain), grads(offloaded))


@pytest.mark.parametrize("prefetch_layers", [1, 2, 3])
def test_layers_kept_in_one_step_are_planned_with_what_they_bring_back_in_the_next(prefetch_layers):
    """After a step that kept every layer, a longer step that must offload some plans their
    copies back in backward with at least their own bytes, not the nothing they brought back."""
    plain, offloaded = budget_model(10**12, prefetch_layers=prefetch_layers)
    for seed in range(2):  # measuring, then everything kept
        assert_same_step(plain, offloaded, batch(seed=seed))
    assert offloaded.activation_offloading_stats().layers_kept_for_budget == LAYERS - 1
    layer_bytes, restore_bytes = measured_layer_bytes()
    engine = offloaded._hf_offload.engine
    for seed, share in enumerate((0.6, 0.8, 1.0)):  # of the twice-as-long step's activations
        budget = int(share * 2 * sum(layer_bytes))
        engine.configure(**{**engine.options(), "max_device_bytes": budget})
        assert_same_step(plain, offloaded, batch(seed=seed, seq=24))
        stats = offloaded.activation_offloading_stats()
        assert stats.peak_resident_bytes <= stats.planned_peak_bytes
        if stats.planned_peak_bytes <= budget:
            assert stats.peak_resident_bytes <= budget, share


def test_the_auto_reserve_is_predicted_for_every_causal_lm_type():
    """The reserve's formula reads every causal-LM config transformers registers (the feed-forward
    width under its many names, or GPT-2's, Bloom's and Falcon's implicit four times the hidden
    size; no heads for Mamba): none falls back to the margin alone."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    unpredicted, checked = {}, 0
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a default config transformers itself cannot build
            continue
        checked += 1
        try:
            assert auto_budget.predicted_step_bytes(config, dtype=torch.bfloat16, tokens=8, fused_loss=False) > 0
        except (TypeError, ValueError, AttributeError) as error:
            unpredicted[model_type] = str(error)
    assert checked > 190 and not unpredicted, unpredicted
    gpt2 = auto_budget.LayerShape.from_config(AutoConfig.for_model("gpt2"))
    assert gpt2.intermediate == 4 * gpt2.hidden


def test_auto_says_when_the_reserve_cannot_be_predicted(fake_device_memory, monkeypatch, caplog):
    """A config the formula cannot read: the budget keeps only its margin, and says so once."""
    model = tiny_model(num_hidden_layers=LAYERS)
    enable_sim(model, max_device_bytes="auto")

    def unreadable(config):
        raise ValueError("config of model_type 'llama' has no usable vocab")

    monkeypatch.setattr(auto_budget.LayerShape, "from_config", unreadable)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for seed in (1, 2):
            train_step(model, batch(seed=seed))
    said = [r.getMessage() for r in caplog.records if "cannot predict" in r.getMessage()]
    assert len(said) == 1 and "vocab" in said[0] and "max_device_bytes=<bytes>" in said[0]
