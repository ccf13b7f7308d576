"""`hf-offload estimate --host-memory --disk-memory --disk-gbps`: where the simulator places each
layer's offloaded inputs, the longest length host and disk hold, and whether the disk hides."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_CONFIGS, enable_sim, tiny_model
from test_estimate import estimate_json, restore_logging  # noqa: F401 (restore_logging: an autouse fixture)
from transformers import AutoConfig

from hf_offload.tools import estimate as estimate_module
from hf_offload.tools.cli import main
from hf_offload.tools.simulator import Simulator, Training

MIB = 2**20
LAYERS = 8  # seven offloaded, the last kept


@pytest.fixture
def model_dir(tmp_path):
    """A Llama of eight layers with a 512-byte input per token per layer (bf16, hidden 256)."""
    config = {
        **TINY_CONFIGS["llama"],
        **dict(model_type="llama", hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=4096),
        "num_hidden_layers": LAYERS,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path




@pytest.mark.parametrize("host_layers", [5.5, 6.0])
def test_the_placement_reported_is_the_engines_for_the_same_budgets(tmp_path, host_layers):
    """The real engine on CPU tensors with a disk directory, and the simulator on meta tensors,
    given the same host and disk budgets, put the same leading layers on disk."""
    overrides = dict(num_hidden_layers=LAYERS, max_position_embeddings=512)
    seq, batch = 256, 2
    layer_bytes = batch * seq * TINY_CONFIGS["llama"]["hidden_size"] * 4  # a float32 checkpoint input
    host_budget, disk_budget = int(host_layers * layer_bytes), 8 * layer_bytes

    model = tiny_model(**overrides)
    model.activation_checkpointing_enable({"use_reentrant": False})
    enable_sim(
        model, disk_dir=tmp_path, max_host_bytes=host_budget, max_disk_bytes=disk_budget,
        keep_last_layers=1, prefetch_layers=1,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_CONFIGS["llama"]["vocab_size"], (batch, seq), generator=generator)
    for _ in range(2):  # the first step measures the layers, the second is planned
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    engine = model.activation_offloading_stats()

    config = AutoConfig.for_model("llama", **{**TINY_CONFIGS["llama"], **overrides})
    # Budgets given as the RAM and free space whose 80% hf_offload's defaults take: exactly the engine's.
    training = Training(
        dtype=torch.float32, batch_size=batch, min_offload_bytes=0, keep_last_layers=1, prefetch_layers=1,
        host_memory_bytes=host_budget / 0.8, disk_memory_bytes=disk_budget / 0.8,
    )  # fmt: skip
    assert (training.host_budget_bytes, training.disk_budget_bytes) == (host_budget, disk_budget)
    step = Simulator(config, training).run("checkpointing+hf_offload", seq)
    request = estimate_module.Request(config=config, name="tiny", training=training, modes=[])
    places, _timing = estimate_module.tier_estimate(step, request)

    assert 0 < engine.planned_disk_layers < LAYERS - 1, "a plan with nothing or everything on disk tests little"
    assert step.tiers.disk_layers == engine.planned_disk_layers == engine.layers_on_disk
    assert places == ["disk"] * engine.layers_on_disk + ["host"] * (engine.layers_offloaded - engine.layers_on_disk) + [
        "device"
    ] * (LAYERS - engine.layers_offloaded)
    assert step.tiers.disk_bytes == engine.disk_offloaded_bytes


def test_host_and_disk_limits_each_lengthen_the_longest_sequence(model_dir, capsys):
    """Seven offloaded layers of 512 bytes per token. Host 0.05 GiB (41 MiB for hf_offload) and
    disk 0.05 GiB: the disk is what runs out. More disk: the host's staging buffers for two disk
    layers run out instead, later. More host: later again. At each longest length the tiers hold
    the step and at the next grid point they do not (the device has room for all of them)."""
    base = ["--model", str(model_dir), "--modes", "checkpointing+hf_offload", "--optimizer-states", "0"]
    base += ["--seq-len", "4096", "--device-memory", "8"]
    found = {}
    for host, disk in [("0.05", "0.05"), ("0.05", "1"), ("0.1", "1")]:
        figures = estimate_json(capsys, *base, "--host-memory", host, "--disk-memory", disk)["modes"]
        search = figures["checkpointing+hf_offload"]["max_seq"]
        longest = figures["checkpointing+hf_offload"]["max_seq_len"]
        probes = {probe["seq_len"]: probe for probe in search["probes"]}
        assert probes[longest]["fits"] and probes[longest + 1024]["fits"] is False, (host, disk)
        assert probes[longest + 1024]["peak_bytes"] <= 8 * 2**30, "the tiers must end it, not the device"
        assert search["tiers"]["fits"] and search["tiers"]["disk_layers"] > 0, (host, disk)
        found[host, disk] = longest
    # The planner's arithmetic: disk d layers of L = 512 bytes x tokens, host (7 - d) + 2 staging.
    assert found["0.05", "0.05"] == 16384  # d = 4: host 5 x 8 MiB <= 41 MiB, disk 32 MiB <= 41
    assert found["0.05", "1"] == 40960  # d = 7: staging 2 x 20 MiB <= 41 MiB
    assert found["0.1", "1"] > found["0.05", "1"]


def test_the_disk_hides_at_a_fast_rate_and_not_at_a_slow_one(model_dir):
    """One layer's write must take no longer than a layer's forward and its read no longer than
    its backward: the verdict flips between twice and half the rate where the write takes just
    the forward's time."""
    config = AutoConfig.from_pretrained(model_dir)
    training = Training(host_memory_bytes=16 * MIB, disk_memory_bytes=1024 * MIB, optimizer_states=0)
    step = Simulator(config, training).run("checkpointing+hf_offload", 8192)
    assert step.tiers.disk_layers > 0 and step.tiers.fits

    def timing(gbps: float):
        request = estimate_module.Request(config=config, name="tiny", training=training, modes=[], disk_gbps=gbps)
        return estimate_module.tier_estimate(step, request)[1]

    edge = timing(1.0)
    assert 0 < edge.forward_seconds < edge.backward_seconds
    at_edge = edge.layer_bytes / edge.forward_seconds / 1e9  # GB/s at which a write takes a layer's forward
    fast, slow = timing(2 * at_edge), timing(at_edge / 2)
    assert fast.hidden and fast.exposed_seconds == 0
    assert not slow.hidden and slow.exposed_seconds > 0
    assert fast.write_seconds == pytest.approx(slow.write_seconds / 4)


def test_the_text_says_where_layers_live_and_whether_the_disk_hides(model_dir, capsys):
    args = ["--model", str(model_dir), "--modes", "checkpointing+hf_offload", "--optimizer-states", "0"]
    args += ["--seq-len", "8192", "--host-memory", "0.02", "--disk-memory", "1", "--disk-gbps", "1000"]
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    assert "of host memory and 1.00 GiB of disk at 1000 GB/s" in out
    assert "on disk" in out and "the disk's time hides behind compute: yes" in out
    assert "7 on the device" in out


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--host-memory", "1", "--disk-memory", "-1"], "disk-memory must be > 0, got -1.0"),
        (["--host-memory", "1", "--disk-memory", "1", "--disk-gbps", "0"], "disk-gbps must be > 0, got 0.0"),
        (["--disk-memory", "10"], "--disk-memory: 10 GiB of disk needs --host-memory"),
        (["--host-memory", "64", "--disk-gbps", "3"], "--disk-gbps: 3 GB/s needs --disk-memory"),
    ],
)
def test_bad_disk_arguments_are_named(capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *args])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_training_refuses_a_disk_without_a_host_budget():
    with pytest.raises(ValueError, match="disk_memory_bytes=1024 needs host_memory_bytes"):
        Training(disk_memory_bytes=1024)
    with pytest.raises(ValueError, match="disk_memory_bytes must be > 0 or None, got -5"):
        Training(host_memory_bytes=1024, disk_memory_bytes=-5)
