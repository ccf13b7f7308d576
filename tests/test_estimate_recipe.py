"""What `hf-offload estimate` prints to add after loading the model (the text's recipe and each
mode's "recipe" in the JSON) configures the model as the step it simulated was configured: each
printed recipe is run on a tiny model, and the state it leaves on the model's modules is compared
with the state the simulator's model had in that step."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

import hf_offload
from hf_offload.internal import simulated_device
from hf_offload.tools import estimate as estimate_module
from hf_offload.tools.cli import main
from hf_offload.tools.modes import is_liger_flce, parse_mode
from hf_offload.tools.simulator import Simulator

MODE = "checkpointing+hf_offload+tiled"
CONFIG = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, head_dim=8, vocab_size=256,
)  # fmt: skip

# Each option that changes the simulated step, in three estimates: tile_heads on one GPU and under
# Ulysses (with the offloading options and the slice size), the budget modes, the disk tier.
AUTO = "checkpointing+hf_offload_auto+tiled"
CASES = {
    "one-gpu": ["--tile-heads", "1", "--modes", MODE, AUTO],
    "ulysses": ["--sp", "2", "--tile-heads", "2", "--batch-size", "2", "--keep-last-layers", "0",
                "--prefetch-layers", "2", "--tile-tokens", "96",
                "--reserve", "nccl=0"],  # fmt: skip  (NCCL's buffers alone exceed the 0.1 GiB simulated)
    "disk-tier": ["--host-memory", "0.0001", "--disk-memory", "1", "--max-device-gib", "0.01"],
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


@pytest.fixture(autouse=True)
def restore_logging():
    levels = {name: logging.getLogger(name).level for name in ("transformers", "hf_offload")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def configuration(model: torch.nn.Module) -> dict:
    """How `model` is set up to train, read from its modules: checkpointing, Liger's fused loss,
    hf_offload's options (less the host budget, which the host's RAM gives, and the disk tier,
    compared on its own) and every tiled module with its slice size and heads per piece."""
    from hf_offload.api import MODEL_STATE_ATTR
    from hf_offload.tiling import attention as heads
    from hf_offload.tiling import loss, per_token

    controller = model.__dict__.get(MODEL_STATE_ATTR)
    offloading = None
    if controller is not None:
        offloading = dataclasses.asdict(controller.options)
        for machine in ("simulate_on_cpu", "max_host_bytes", "disk_dir"):
            offloading.pop(machine)
    tiled = {}
    for name, module in model.named_modules():
        state = module.__dict__
        for attr in (per_token.STATE_ATTR, per_token.PROJECTIONS_ATTR, loss.LOSS_STATE_ATTR):
            if attr in state:
                tiled[(name, attr)] = state[attr].tile_tokens
        if heads.HEADS_ATTR in state:
            split = state[heads.HEADS_ATTR]
            tiled[(name, heads.HEADS_ATTR)] = (split.min_tokens, split.heads_per_piece)
    return {
        "checkpointing": model.is_gradient_checkpointing,
        "liger": is_liger_flce(model),
        "offloading": offloading,
        "tiling": tiled,
    }


def printed_recipes(capsys, monkeypatch, args: list[str]) -> tuple[estimate_module.Request, dict]:
    """The request simulated, and the recipes printed for it, from one simulation: the text's (for
    the longest mode) and the JSON's of each mode, as {where: (mode, lines)}."""
    requests, once = [], []
    simulate = estimate_module.run_estimate

    def simulated_once(request, *rest, **kwargs):
        if not once:
            requests.append(request)
            once.append(simulate(request, *rest, jobs=1, **kwargs))
        return once[0]

    monkeypatch.setattr(estimate_module, "run_estimate", simulated_once)
    assert main(["estimate", *args]) == 0
    text = capsys.readouterr().out
    assert main(["estimate", *args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    after = text.split("add after loading the model, with `import hf_offload`:\n", 1)[1]
    lines = []
    for line in after.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line.strip())
    recipes = {"text": (result["longest"]["mode"], lines)}
    recipes.update({f"json {mode}": (mode, entry["recipe"]) for mode, entry in result["modes"].items()})
    return requests[0], recipes


def run_recipe(lines: list[str], config, memory_bytes: int, monkeypatch, disk_dir) -> tuple[dict, list]:
    """The printed lines, run as written after loading a model of `config` (Ulysses's registration,
    which needs the ranks of a launch, recorded instead)."""
    from transformers import AutoModelForCausalLM

    from hf_offload.integrations import sequence_parallel

    registered = []

    def register_ulysses(*args, **kwargs):
        registered.append((args, kwargs))

    monkeypatch.setattr(sequence_parallel, "register_ulysses", register_ulysses)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    code = "\n".join(lines).replace(estimate_module.DISK_DIR, str(disk_dir))
    try:
        # "auto" reads the device's memory: the simulated device's, as a GPU of that memory answers.
        with simulated_device(lambda: (memory_bytes, memory_bytes)):
            exec(code, {"model": model, "hf_offload": hf_offload})  # the recipe as printed
        return configuration(model), registered
    finally:
        hf_offload.disable_sequence_tiling(model)
        if hf_offload.is_activation_offloading(model):
            hf_offload.disable_activation_offloading(model)


def simulated_configuration(request, mode: str) -> dict:
    simulator = Simulator(request.config, request.training)
    with simulator._configured(parse_mode(mode)):
        return configuration(simulator.base)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_printed_recipe_configures_the_model_as_simulated(case, model_dir, capsys, monkeypatch, tmp_path):
    args = ["--model", str(model_dir), "--modes", MODE, "--device-memory", "0.1", "--seq-len", "512",
            "--granularity", "2048", "--optimizer-states", "0", *CASES[case]]  # fmt: skip
    request, recipes = printed_recipes(capsys, monkeypatch, args)
    training = request.training
    for where, (mode, lines) in recipes.items():
        configured, registered = run_recipe(lines, request.config, request.memory_bytes, monkeypatch, tmp_path)
        assert configured == simulated_configuration(request, mode), (where, lines)
        assert configured["offloading"] is not None and configured["tiling"], (where, lines)
        disk = any("disk_dir=" in line for line in lines)
        assert disk == (training.disk_memory_bytes is not None), (where, lines)
        ulysses = [(training.sp_size, training.batch_size)] if training.sp_size > 1 else []
        assert [(kwargs["sp_size"], kwargs["micro_batch_size"]) for _args, kwargs in registered] == ulysses, where
