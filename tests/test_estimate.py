"""`hf-offload estimate`: the command over the simulator, its output and its errors."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import TINY_CONFIGS

from hf_offload.tools import estimate as estimate_module
from hf_offload.tools.cli import main

GIB = 2**30


def simulate_once(monkeypatch) -> None:
    """`estimate` simulates once and answers each later run with that result (the text and the
    JSON of one simulation, without paying for it again)."""
    simulate, once = estimate_module.run_estimate, []

    def simulated_once(*args, **kwargs):
        if not once:
            once.append(simulate(*args, **kwargs))
        return once[0]

    monkeypatch.setattr(estimate_module, "run_estimate", simulated_once)


@pytest.fixture
def model_dir(tmp_path):
    """A local model directory with only a config.json: a tiny Llama with a vocabulary large
    enough for the loss head to matter."""
    config = {
        **TINY_CONFIGS["llama"],
        **dict(model_type="llama", hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=4096),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(autouse=True)
def restore_logging():
    # The command quiets transformers' and hf_offload's loggers for its own output.
    levels = {name: logging.getLogger(name).level for name in ("transformers", "hf_offload")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def estimate_json(capsys, *args) -> dict:
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_every_mode_with_its_figures(model_dir, capsys):
    result = estimate_json(capsys, "--model", str(model_dir), "--seq-len", "256", "--optimizer-states", "0")
    assert set(result["modes"]) == {"none", "hf_offload", "checkpointing", "checkpointing+hf_offload"}
    for mode, figures in result["modes"].items():
        assert figures["peak_bytes"] > 0 and figures["flops"] > 0, mode
        offloads = "hf_offload" in mode
        assert (figures["host_bytes"] is not None) == offloads
        assert (figures["offloaded_bytes"] is not None) == offloads
        assert "max_seq_len" not in figures  # only with a device memory
        assert sum(part["bytes"] for part in figures["peak"]["parts"]) + figures["peak"]["workspace_bytes"] == (
            figures["peak_bytes"]
        )
    modes = result["modes"]
    assert modes["checkpointing"]["peak_bytes"] < modes["none"]["peak_bytes"]
    assert result["setup"]["simulated"] is True


def test_checkpointing_flag_and_liger_choose_the_modes(model_dir, capsys):
    args = ["--model", str(model_dir), "--seq-len", "256", "--checkpointing", "--liger", "--optimizer-states", "0"]
    result = estimate_json(capsys, *args)
    assert list(result["modes"]) == [
        "checkpointing",
        "checkpointing+hf_offload",
        "checkpointing+liger",
        "checkpointing+hf_offload+liger",
    ]
    assert result["modes"]["checkpointing+liger"]["peak_bytes"] < result["modes"]["checkpointing"]["peak_bytes"]


def test_longest_sequence_fits_and_the_next_grid_step_does_not(model_dir, capsys):
    memory = 0.25  # GiB, of which the H200's cuBLAS workspaces take 64 MiB
    result = estimate_json(
        capsys, "--model", str(model_dir), "--modes", "checkpointing", "checkpointing+hf_offload",
        "--seq-len", "512", "--device-memory", str(memory), "--granularity", "256", "--optimizer-states", "0",
    )  # fmt: skip
    for mode, figures in result["modes"].items():
        longest, search = figures["max_seq_len"], figures["max_seq"]
        assert longest is not None and longest % 256 == 0, mode
        fits = {probe["seq_len"]: probe["fits"] for probe in search["probes"]}
        assert fits[longest] and fits[longest + 256] is False, mode
        assert search["peak_bytes"] <= memory * GIB
    modes = result["modes"]
    assert modes["checkpointing+hf_offload"]["max_seq_len"] >= modes["checkpointing"]["max_seq_len"]


def test_a_search_run_two_steps_at_a_time_finds_what_one_at_a_time_does(model_dir):
    """One mode on a machine with two CPUs: the search's foreseeable steps run two at a time, one
    in a forked process; the answer, every probe and the step reported are those of the search
    that runs its steps one by one."""
    import multiprocessing
    import os

    import torch

    from hf_offload.tools.presets import load_config
    from hf_offload.tools.simulator import Simulator, Training

    request = estimate_module.Request(
        config=load_config(str(model_dir)), name="tiny", training=Training(dtype=torch.float32),
        modes=["checkpointing"], seq_len=512, memory_bytes=int(0.25 * GIB), granularity=256,
    )  # fmt: skip
    fork = multiprocessing.get_context("fork")
    forked = fork.Value("i", 0)  # steps simulated in a forked process (the counter is shared with it)
    parent = os.getpid()
    found = {}
    for pair in (None, fork):
        simulator = Simulator(request.config, request.training)
        simulate = simulator.run

        def counted(*args, simulate=simulate, **kwargs):
            if os.getpid() != parent:
                with forked.get_lock():
                    forked.value += 1
            return simulate(*args, **kwargs)

        simulator.run = counted
        entry = estimate_module._estimate_mode(simulator, request, "checkpointing", pair=pair)
        found[pair is None] = (
            entry.longest.max_seq_len,
            [(p.seq_len, p.peak_bytes, p.fits) for p in sorted(entry.longest.probes, key=lambda p: p.seq_len)],
            entry.step.peak_bytes,
        )
    assert found[True][0] is not None
    assert forked.value >= 2  # the first two lengths' pair, and the prediction's
    assert found[False] == found[True]


def test_tile_simulates_sequence_tiling_with_the_slices_asked_for(model_dir, capsys):
    """--tile adds MODE+tiled; at 2048 tokens of a 4096-word vocabulary the loss head's logits make
    the untiled peak, and slices of 256 tokens leave a lower one; --tile-tokens is in the setup."""
    args = ["--model", str(model_dir), "--seq-len", "2048", "--modes", "checkpointing+hf_offload", "--tile"]
    result = estimate_json(capsys, *args, "--tile-tokens", "256", "--optimizer-states", "0")
    modes = result["modes"]
    assert set(modes) == {"checkpointing+hf_offload", "checkpointing+hf_offload+tiled"}
    assert modes["checkpointing+hf_offload+tiled"]["peak_bytes"] < 0.8 * modes["checkpointing+hf_offload"]["peak_bytes"]
    assert modes["checkpointing+hf_offload+tiled"]["flops"] > modes["checkpointing+hf_offload"]["flops"]  # recomputed
    assert result["setup"]["tile_tokens"] == 256


def test_text_output_names_where_the_peak_is(model_dir, capsys):
    # 2048 tokens: a layer input of 1 MiB, over min_offload_bytes.
    args = ["--model", str(model_dir), "--seq-len", "2048", "--modes", "checkpointing+hf_offload"]
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    assert "simulated on the meta device" in out
    assert "checkpointing+hf_offload: " in out and "at the peak, in backward" in out
    assert "weights:" in out and "cuBLAS workspaces:" in out
    assert "per offloaded layer:" in out and "copies hide behind compute:" in out
    assert "assumed device: h200 (the default" in out


def test_list_devices(capsys):
    assert main(["estimate", "--list-devices"]) == 0
    out = capsys.readouterr().out
    assert "| h200 | 789 |" in out and "cuBLAS workspace MiB" in out


@pytest.mark.parametrize(
    "config,fragment",
    [
        (None, "has no config.json"),
        ({"model_type": "llama", "hidden_size": 0, "num_hidden_layers": 2, "vocab_size": 10},
         "field 'hidden_size' must be a positive integer, got 0"),
        ({"model_type": "not-a-model"}, "cannot read"),
        ({"model_type": "my-remote", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}, "--trust-remote-code"),
    ],
)  # fmt: skip
def test_a_bad_config_is_named(tmp_path, capsys, config, fragment):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --model" in err and fragment in err


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--modes", "trl_offload"], "trl_offload cannot be simulated"),
        (["--modes", "checkpointing+hf_offload_auto"], "give --device-memory or --device"),
        (["--efficiency", "2"], "must be a fraction in (0, 1]"),
        (["--optimizer-states", "1"], "invalid choice: 1"),
        (["--seq-len", "1"], "seq-len must be >= 2"),
    ],
)
def test_bad_arguments_are_named(capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *args])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_budget_options_reach_the_engine(model_dir, capsys):
    """--max-device-gib gives hf_offload a device-memory budget (two steps: the first measures);
    --host-memory a host budget, over which tensors stay on the device."""
    base = ["--model", str(model_dir), "--seq-len", "512", "--modes", "hf_offload", "--optimizer-states", "0"]
    unlimited = estimate_json(capsys, *base)["modes"]["hf_offload"]
    tight_host = estimate_json(capsys, *base, "--host-memory", str(1 / 1024))["modes"]["hf_offload"]
    assert tight_host["host_bytes"] < unlimited["host_bytes"]
    assert tight_host["peak_bytes"] > unlimited["peak_bytes"]  # what could not move stayed on the device


def test_with_a_device_the_answer_comes_first_with_its_recipe(model_dir, capsys, monkeypatch):
    """`estimate --model PATH --device ...`: first the longest sequence per mode (the longest
    context's mode among them), then the lines that reach the longest, then the details; the JSON
    gains the same answer and each mode's recipe. (Slices of 512 tokens tile the loss head's 4096-word
    logits too: the tiled mode goes furthest.)"""
    args = ["--model", str(model_dir), "--device", "h100-80gb", "--device-memory", "0.5", "--seq-len", "512",
            "--granularity", "512", "--optimizer-states", "0", "--tile-tokens", "512", "--checkpointing"]  # fmt: skip
    simulate_once(monkeypatch)
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    answer, details = out.index("Longest sequence in 512.0 MiB"), out.index("peak at")
    assert answer < out.index("To train") < details
    listed = out[answer : out.index("To train")]
    for mode in ("checkpointing", "checkpointing+hf_offload", "checkpointing+hf_offload+tiled"):
        assert f"  {mode} " in listed
    lines = ["model.activation_checkpointing_enable()", "model.enable_activation_offloading()",
             "model.enable_sequence_tiling(tile_tokens=512)"]  # fmt: skip
    assert "(checkpointing+hf_offload+tiled), add after loading the model" in out
    assert "\n".join(f"    {line}" for line in lines) in out
    result = estimate_json(capsys, *args)
    best = result["longest"]
    assert best["mode"] == "checkpointing+hf_offload+tiled"
    assert best["max_seq_len"] == max(m["max_seq_len"] for m in result["modes"].values())
    assert result["modes"][best["mode"]]["recipe"] == lines
    assert result["modes"]["checkpointing"]["recipe"] == lines[:1]


# -- positions kept in a table (GPT-2's learned `wpe`): the length a model can run at all ----------


@pytest.fixture
def gpt2_dir(tmp_path):
    """A tiny GPT-2: learned absolute positions, a table of n_positions=512 rows."""
    config = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=256)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "model_type, options, expected",
    [
        ("gpt2", dict(n_positions=512), ("n_positions", 512)),
        ("opt", dict(max_position_embeddings=512), ("max_position_embeddings", 512)),  # a table of 514 rows
        ("llama", dict(max_position_embeddings=512), None),  # rotary: no table
        ("bloom", {}, None),  # ALiBi: no table
    ],
)
def test_a_table_of_positions_is_found_by_its_config_field(model_type, options, expected):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_offload.tools.simulator import position_table

    small = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=256)
    config = AutoConfig.for_model(model_type, **(small if model_type != "gpt2" else {}), **options)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    table = position_table(model, config)
    assert (None if table is None else (table.field, table.rows)) == expected


def test_a_length_past_the_table_is_refused_by_name(gpt2_dir, capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--model", str(gpt2_dir), "--seq-len", "1024"])
    error = capsys.readouterr().err
    assert "n_positions=512" in error and "1,024" in error and "at most 512" in error


def test_the_default_length_and_the_search_stop_at_the_table(gpt2_dir, capsys):
    """Without --seq-len the estimate runs at the table's length and says so; the longest sequence
    is the table's, marked as such, with no step simulated past it (on meta the lookup past the
    table would run, as it cannot on a GPU)."""
    result = estimate_json(capsys, "--model", str(gpt2_dir), "--device-memory", "8", "--modes", "checkpointing")
    figures = result["modes"]["checkpointing"]
    assert figures["seq_len"] == 512 and result["setup"]["position_table"] == {
        "field": "n_positions", "rows": 512, "module": "transformer.wpe"}  # fmt: skip
    search = figures["max_seq"]
    assert figures["max_seq_len"] == 512 and search["reached_limit"] and search["limit"] == 512
    assert max(probe["seq_len"] for probe in search["probes"]) == 512
    assert main(["estimate", "--model", str(gpt2_dir), "--device-memory", "8", "--modes", "checkpointing"]) == 0
    text = capsys.readouterr().out
    assert "512*" in text and "n_positions=512" in text and "default length cut" in text


def test_grpos_generation_stops_at_the_table_too(gpt2_dir, capsys):
    """GRPO's answer comes from generation's limit where generation binds; a model with a position
    table cannot generate past it either: 512 rows less a 128-token prompt, marked as the table's."""
    result = estimate_json(capsys, "--model", str(gpt2_dir), "--lora-rank", "4", "--trainer", "grpo",
                           "--prompt-length", "128", "--device-memory", "8", "--modes", "checkpointing")  # fmt: skip
    search = result["modes"]["checkpointing"]["max_seq"]
    assert result["modes"]["checkpointing"]["max_seq_len"] == 384
    assert search["reached_limit"] and search["limit"] == 384


def test_the_simulator_refuses_a_step_past_the_table():
    from transformers import AutoConfig

    from hf_offload.tools.simulator import Simulator

    simulator = Simulator(AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=4, n_positions=256, vocab_size=64))
    assert simulator.run("none", 256).peak_bytes > 0
    with pytest.raises(ValueError, match=r"n_positions=256 .*257 tokens"):
        simulator.run("none", 257)
