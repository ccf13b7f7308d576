"""The `hf-offload` commands' arguments checked before anything is loaded, simulated or trained:
each bad value or combination fails at once with the option named, what is wrong and what would
be valid. Mostly `estimate`; `bench` and `demo` share its checks of a model directory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_offload.tools.estimate as estimate_module
from hf_offload.tools import presets
from hf_offload.tools.cli import main

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fails the test if the model's config is read or anything simulated."""

    def loaded(*args, **kwargs):
        raise AssertionError("the error should have come before the config was read or anything simulated")

    monkeypatch.setattr(presets, "load_config", loaded)
    monkeypatch.setattr(estimate_module, "run_estimate", loaded)


def error_of(capsys, *args: str, command: str = "estimate") -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def config_dir(tmp_path, content: str, name: str = "model"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(content)
    return directory


@pytest.mark.parametrize(
    "content,fragment",
    [
        ('{"model_type": "llama",', "config.json is not valid JSON: Expecting property name"),
        ("[1, 2]", "config.json holds a JSON list, not an object of a config's fields"),
        ('{"hidden_size": 64}', "config.json has no field 'model_type' (such as \"llama\")"),
    ],
)
def test_a_config_json_that_cannot_be_one_is_named_before_anything_loads(
    tmp_path, capsys, nothing_loaded, content, fragment
):
    assert fragment in error_of(capsys, "--model", str(config_dir(tmp_path, content)))


@pytest.mark.parametrize("path", ["/no/such/model", "./no/such/model", "~/no-such-model-dir", "models/x/y"])
def test_a_missing_local_path_is_not_taken_for_a_hub_id(capsys, nothing_loaded, path):
    err = error_of(capsys, "--model", path)
    assert f"argument --model: {path!r}: no such directory" in err and "hub id '" not in err


def test_text_that_is_neither_a_path_nor_a_hub_id(capsys, nothing_loaded):
    assert "'two words' is neither a local directory nor a hub id ('name' or 'org/name')" in error_of(
        capsys, "--model", "two words"
    )


def test_an_encoder_is_refused_as_not_a_causal_lm(tmp_path, capsys):
    """BERT's config at the default 8192 tokens gave a raw traceback from its position embeddings
    (512); at 256 tokens it was simulated as a causal LM. Its config says it is an encoder."""
    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 128}  # fmt: skip
    for seq in ("8192", "256"):
        err = error_of(capsys, "--model", str(config_dir(tmp_path, json.dumps(bert), f"bert{seq}")), "--seq-len", seq)
        assert "a bert encoder (is_decoder is false)" in err and '"is_decoder": true' in err


def test_a_model_type_without_a_causal_lm_is_refused(tmp_path, capsys):
    t5 = {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 4, "d_ff": 128, "vocab_size": 128}
    err = error_of(capsys, "--model", str(config_dir(tmp_path, json.dumps(t5))))
    assert "model_type 't5' has no causal-LM class in transformers (AutoModelForCausalLM)" in err
    assert "such as llama, qwen2, mistral, gemma" in err


def test_a_config_json_file_is_read_as_its_directory(tmp_path, capsys):
    file = config_dir(tmp_path, json.dumps(LLAMA)) / "config.json"
    assert main(["estimate", "--model", str(file), "--seq-len", "64", "--modes", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["model"] == str(file)


def test_offline_a_hub_id_not_in_the_cache_fails_at_once_saying_so(capsys, monkeypatch):
    """Offline, huggingface_hub retried for about 25 s before its error; now the cache alone is
    asked, and the error says what to do."""
    monkeypatch.setattr(presets, "_hub_reachable", lambda: False)
    err = error_of(capsys, "--model", "no-such-org/no-such-model-for-hf-offload")
    assert "the hub cannot be reached from here (offline)" in err and "give that directory" in err


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--trust-remote-code"], "argument --trust-remote-code: only with --model"),
        (["--lora-targets", "q_proj"], "argument --lora-targets: 'q_proj' needs --lora-rank N"),
        (["--lora-rank", "4", "--lora-targets", "q_proj,,v_proj"], "'q_proj,,v_proj' has an empty name"),
        (["--tile-tokens", "512"], "argument --tile-tokens: 512 tokens per slice needs --tile or a +tiled mode"),
        (["--granularity", "512"], "searched only with --device or --device-memory"),
        (["--sp", "2", "--padded"], "a padded batch under sequence parallelism is not simulated"),
        (["--modes", "transformers_offload"], "transformers_offload cannot be simulated"),
        (["--disk-memory", "10"], "needs --host-memory GIB"),
    ],
)
def test_combinations_that_would_be_ignored_or_fail_later_are_named_first(capsys, nothing_loaded, args, fragment):
    assert fragment in error_of(capsys, *args)


def test_a_model_that_fails_in_its_own_code_is_a_clear_error(tmp_path, capsys, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("The expanded size of the tensor (8192) must match the existing size (512)\nmore")

    monkeypatch.setattr(estimate_module, "run_estimate", fails)
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", str(config_dir(tmp_path, json.dumps(LLAMA))), "--modes", "none"])
    err = capsys.readouterr().err
    assert "at 8192 tokens: the model failed: RuntimeError: The expanded size of the tensor (8192)" in err
    # Not the arguments' failure: no usage text, and not argparse's exit status 2.
    assert exit_info.value.code == 1 and "usage:" not in err


def test_a_mixture_of_experts_with_lora_is_simulated(tmp_path, capsys):
    """PEFT 0.22's LoRA on expert parameters opens `torch.autocast(device_type=W.device.type,
    enabled=False)`, which PyTorch refuses for "meta" ("unsupported scalarType"): the simulator
    answers it as the CPU's autocast (stand_ins.autocast_regions_on_meta)."""
    moe = {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
           "max_position_embeddings": 4096}  # fmt: skip
    args = ["--model", str(config_dir(tmp_path, json.dumps(moe))), "--lora-rank", "4", "--seq-len", "512"]
    assert main(["estimate", *args, "--modes", "none"]) == 0
    assert "none:" in capsys.readouterr().out


def test_a_mode_that_moved_nothing_says_why(tmp_path, capsys):
    """A small model at a short length: every saved tensor is under min_offload_bytes, and the
    estimate says so instead of a bare 0 moved."""
    args = ["--model", str(config_dir(tmp_path, json.dumps(LLAMA))), "--seq-len", "64", "--modes", "hf_offload"]
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    assert "hf_offload moved nothing: the saved tensors it saw stayed on the device:" in out
    assert "under min_offload_bytes (0.5 MiB)" in out


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_bench_and_demo_name_a_config_json_without_a_model_type(tmp_path, capsys, command):
    """bench raised transformers' ValueError with a traceback."""
    err = error_of(capsys, "--model", str(config_dir(tmp_path, '{"hidden_size": 64}')), command=command)
    assert "config.json has no field 'model_type'" in err


def test_bench_refuses_an_encoder_instead_of_training_it_as_a_causal_lm(tmp_path, capsys, monkeypatch):
    """bench built BERT's BertLMHeadModel (bidirectional without is_decoder) and measured it."""
    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 128}  # fmt: skip
    monkeypatch.setattr("hf_offload.tools.bench.run_bench", lambda args: pytest.fail("the bench ran"))
    err = error_of(capsys, "--model", str(config_dir(tmp_path, json.dumps(bert))), command="bench")
    assert "a bert encoder (is_decoder is false)" in err


# A bad argument fails before the command imports transformers (5-20 s with torch), and where its
# check needs no device, before torch. Measured in a fresh interpreter (this one has imported
# everything): the probe calls the console script's entry in-process, catches its exit, and reads
# sys.modules at that moment. The cases run in one interpreter, in order, so those allowed torch
# come last.
PROBE = """
import contextlib, importlib, io, json, sys
for name in sys.argv[3:]:
    importlib.import_module(name)
module, function = sys.argv[1].split(":")
main = getattr(importlib.import_module(module), function)
results = []
for argv in json.loads(sys.argv[2]):
    error = io.StringIO()
    with contextlib.redirect_stderr(error):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    imported = [name for name in ("torch", "transformers") if name in sys.modules]
    results.append({"code": code, "error": error.getvalue(), "imported": imported})
print(json.dumps(results))
"""

FAIL_BEFORE_TORCH = [
    (["estimate", "--seq-len", "-5"], "argument --seq-len: seq-len must be >= 2, got -5"),
    (["estimate", "--modes", "bogus"], "argument --modes: invalid choice: 'bogus'"),
    (["estimate", "--device", "nosuch"], "argument --device: invalid choice: 'nosuch'"),
    (["estimate", "--model", "/no/such/model"], "argument --model: '/no/such/model': no such directory"),
    (["estimate", "--tile-tokens", "512"], "512 tokens per slice needs --tile or a +tiled mode"),
    (["estimate", "--bnb-4bit-quant-type", "nf4"], "describes a 4-bit base: give --load-in-4bit too"),
    (["estimate", "--load-in-4bit"], "a 4-bit base is trained through adapters: give --lora-rank"),
    (["estimate", "--modes", "hf_offload_auto"], "hf_offload_auto reads the device's free memory"),
    (["estimate", "--device", "h100-80gb", "--reserve", "buckets=1"], "argument --reserve: 'buckets=1': unknown item"),
    (["demo", "--steps", "0"], "argument --steps: steps must be >= 1, got 0"),
    (["demo", "--device", "CUDA:x"], "argument --device: 'CUDA:x' is not a torch device; use cpu, cuda or cuda:N"),
    (["demo", "--model", "/no/such/model"], "argument --model: '/no/such/model' is not a local directory"),
    (["bench", "--model", "/no/such/model"], "argument --model: '/no/such/model' is not a local directory"),
    (["bench", "--seq-lens", "1"], "argument --seq-lens: seq-lens must be >= 2, got 1"),
    (["bench", "--verify"], "argument --verify: only with --find-max-seq"),
    (["bench", "--find-max-seq", "--seq-lens", "64"], "argument --seq-lens: not with --find-max-seq"),
    (["bench", "--find-max-seq", "--batch-size", "2"], "--find-max-seq measures batch 1, got 2"),
    (["bench", "--find-max-seq", "--verify"], "argument --verify: only with --method slope"),
    (
        ["bench", "--find-max-seq", "--method", "slope", "--slope-lens", "64", "32"],
        "the second length must be longer than the first, got 64 32",
    ),
]
# Whether a device is available here is torch's to say.
FAIL_BEFORE_TRANSFORMERS = [
    (["demo", "--device", "nosuch"], "argument --device: 'nosuch' is not a torch device; use cpu, cuda or cuda:N"),
    (["bench", "--device", "nosuch"], "argument --device: 'nosuch' is not a torch device"),
    (["bench", "--find-max-seq", "--start", "4096", "--seq-limit", "2048"], "2048 is below --start 4096"),
]
CASES = [(argv, fragment, ()) for argv, fragment in FAIL_BEFORE_TORCH] + [
    (argv, fragment, ("torch",)) for argv, fragment in FAIL_BEFORE_TRANSFORMERS
]


def console_script_entry() -> str:
    """The `hf-offload` entry point pyproject.toml names (module:function)."""
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    return re.search(r'^hf-offload = "([\w.:]+)"$', pyproject, re.MULTILINE).group(1)


def probe(cases: list, *imported_first: str) -> list[dict]:
    argvs = json.dumps([argv for argv, _, _ in cases])
    command = [sys.executable, "-c", PROBE, console_script_entry(), argvs, *imported_first]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_failed_before_imports(result: dict, fragment: str, allowed: tuple[str, ...]) -> None:
    assert result["code"] == 2 and fragment in result["error"], result
    assert set(result["imported"]) <= set(allowed), f"imported {result['imported']} before: {result['error']}"


@pytest.fixture(scope="module")
def probed() -> list[dict]:
    return probe(CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(argv) for argv, _, _ in CASES])
def test_a_bad_argument_fails_before_the_heavy_imports(probed, index):
    """Each bad argument waited 13-21 s of imports (torch, transformers) before its error."""
    _, fragment, allowed = CASES[index]
    assert_failed_before_imports(probed[index], fragment, allowed)


def test_the_check_catches_an_error_raised_after_the_imports():
    """Companion: the same argument, its error raised once transformers is imported (as the
    command did, whose module imported transformers before it parsed), fails the check."""
    argv, fragment, allowed = CASES[0]
    (result,) = probe([CASES[0]], "transformers")
    assert fragment in result["error"] and "transformers" in result["imported"]
    with pytest.raises(AssertionError, match="imported"):
        assert_failed_before_imports(result, fragment, allowed)


def test_the_module_runs_as_the_command():
    """`python -m hf_offload.tools.cli`, as the docs and the GPU checks run it."""
    command = [sys.executable, "-m", "hf_offload.tools.cli", "estimate", "--seq-len", "-5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "argument --seq-len: seq-len must be >= 2, got -5" in done.stderr
