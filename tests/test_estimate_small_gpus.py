"""The GPUs and desktops people own: tiling's default slices sized to the device's memory, the
device and model presets, and what a host's RAM ends (and a disk tier beside it reaches)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_CONFIGS
from test_estimate import estimate_json, restore_logging  # noqa: F401 (restore_logging: an autouse fixture)
from transformers import AutoModelForCausalLM

from hf_offload.auto_budget import LayerShape, simulated_device
from hf_offload.tiling import default_tile_tokens
from hf_offload.tiling.loss import LOSS_BYTES_PER_ELEMENT, LOSS_TILE_ELEMENTS, SLICE_DEVICE_SHARE, loss_tile_tokens
from hf_offload.tools import estimate as estimate_module
from hf_offload.tools.cli import main
from hf_offload.tools.devices import DEVICES
from hf_offload.tools.presets import preset_config
from hf_offload.tools.simulator import Simulator, Training, composition

GIB = 2**30


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.3-70b", "qwen3-8b"])
def test_default_slices_take_a_share_of_the_device_whatever_its_size(preset):
    """The layers' slices are hidden_size tokens and the loss head's 2**28 elements where the
    device's memory is large (and on the CPU, which has no device memory); on a smaller device each
    is cut so that its working memory (an MLP slice at 16 bytes per token and unit of width, a loss
    slice at 12 bytes a logit) stays within SLICE_DEVICE_SHARE of the memory."""
    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = LayerShape.from_config(config)
    meta = torch.device("meta")
    assert default_tile_tokens(model) == config.hidden_size  # no device memory to read
    assert loss_tile_tokens(shape.vocab, meta) == LOSS_TILE_ELEMENTS // shape.vocab
    previous = (0, 0)
    for gib in (8, 12, 16, 24, 32, 48, 80, 141, 1000):
        with simulated_device(lambda gib=gib: (0, gib * GIB)):
            layer, loss = default_tile_tokens(model), loss_tile_tokens(shape.vocab, meta)
        share = gib * GIB * SLICE_DEVICE_SHARE
        mlp_slice = shape.intermediate * 16  # bytes per token
        assert layer == config.hidden_size or layer * mlp_slice <= share < (layer + 1) * mlp_slice
        assert loss * shape.vocab <= LOSS_TILE_ELEMENTS and loss * shape.vocab * LOSS_BYTES_PER_ELEMENT <= share
        assert (layer, loss) >= previous
        previous = (layer, loss)
    assert previous == (config.hidden_size, LOSS_TILE_ELEMENTS // shape.vocab)


def test_a_small_device_keeps_the_loss_head_from_deciding_the_peak():
    """A tiled step on a small device: with the slices sized to it, the loss head's share of the
    peak is within SLICE_DEVICE_SHARE of the memory; with the defaults of a device without memory
    to read (the loss in 2**28-element slices, here one slice for the whole sequence) the loss head
    holds the peak, at several times that."""
    config = preset_config("tiny")
    config.num_hidden_layers = 2  # a 2048-word vocabulary: 4096 tokens in one default loss slice
    memory = GIB // 4
    loss_head = {}
    for device_memory in (None, memory):
        training = Training(lora_rank=4, optimizer_states=0, device_memory_bytes=device_memory)
        step = Simulator(config, training).run("checkpointing+tiled", 4096)
        loss_head[device_memory] = sum(part.bytes for part in composition(step.peak) if part.what == "loss head")
    assert loss_head[memory] <= memory * SLICE_DEVICE_SHARE
    assert loss_head[None] > 4 * memory * SLICE_DEVICE_SHARE


@pytest.mark.parametrize("name", ["rtx3060", "rtx4060ti-16gb", "rtx4090", "rtx5090", "l4", "a10g", "a6000", "l40s"])
def test_device_presets_for_the_gpus_people_own(name):
    """Every preset names its source and is derated as the others: memory less 1.4 GiB of the
    card's, compute 0.8 of the datasheet's (in the source line)."""
    device = DEVICES[name]
    card_mib = int(device.source.split(" MiB")[0].rsplit(" ", 1)[1])
    assert device.memory_gib == round(card_mib / 1024 - 1.4, 1)
    tflops = float(device.source.split(" TFLOP/s")[0].rsplit(" ", 1)[1])
    assert device.tflops == round(tflops * 0.8)
    assert device.compute_capability >= (8, 0)


@pytest.fixture
def eight_layers(tmp_path):
    """A Llama of eight layers whose checkpoint inputs take 512 bytes per token each (bf16, hidden 256)."""
    config = {
        **TINY_CONFIGS["llama"],
        **dict(model_type="llama", hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=4096),
        "num_hidden_layers": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_past_the_hosts_memory_the_answer_says_what_a_disk_tier_reaches(eight_layers, capsys, monkeypatch):
    """A host of 25 MiB (20 MiB for hf_offload) holds the offloaded inputs (seven layers of 512
    bytes a token) of under 6k tokens. Without a disk the engine keeps what the host cannot take on
    the device, which ends the longest length early; the answer then also searches with a disk tier
    beside the host and says how far it goes and the host memory and disk that takes."""
    args = ["--model", str(eight_layers), "--modes", "checkpointing+hf_offload", "--optimizer-states", "0",
            "--seq-len", "4096", "--device-memory", "0.75", "--granularity", "512",
            "--host-memory", "0.025"]  # fmt: skip
    simulate, once = estimate_module.run_estimate, []

    def simulated_once(*args, **kwargs):  # the JSON and the text of one simulation
        if not once:
            once.append(simulate(*args, **kwargs))
        return once[0]

    monkeypatch.setattr(estimate_module, "run_estimate", simulated_once)
    result = estimate_json(capsys, *args)
    longest = result["longest"]
    at_answer = result["modes"]["checkpointing+hf_offload"]["max_seq"]
    assert at_answer["host_bytes"] <= 0.025 * GIB * 0.8
    with_disk = longest["with_disk"]
    assert with_disk is not None and with_disk["max_seq_len"] > longest["max_seq_len"]
    tiers = with_disk["tiers"]
    assert tiers["fits"] and tiers["disk_bytes"] > 0
    assert tiers["host_bytes"] <= 0.025 * GIB * 0.8
    assert main(["estimate", *args]) == 0
    assert f"reaches {with_disk['max_seq_len']:,} tokens: host" in capsys.readouterr().out
