"""GRPO's generation ends at the model's positions (with its rope scaling) and, with vLLM, at its
max_model_len as TRL 1.16 passes it (`hf_offload.tools.generation_limits`)."""

from __future__ import annotations

import pytest
from test_estimate import estimate_json, restore_logging  # noqa: F401 (restore_logging: autouse)

from hf_offload.tools import grpo_generation
from hf_offload.tools.cli import main
from hf_offload.tools.generation_limits import model_positions, parse_rope_scaling, with_rope_scaling
from hf_offload.tools.presets import preset_config

# tiny: 2,048 positions (LlamaConfig's default max_position_embeddings); memory enough for far more.
GRPO_TINY = ["--preset", "tiny", "--lora-rank", "4", "--trainer", "grpo", "--num-generations", "2", "--modes",
             "checkpointing", "--granularity", "256", "--optimizer-states", "0", "--prompt-length", "64",
             "--device-memory", "4"]  # fmt: skip


def test_positions_are_read_as_vllm_derives_them():
    """max_position_embeddings as the config has it; Llama 3.1's "llama3" scaling is already in it;
    YaRN stretches original_max_position_embeddings by its factor (Qwen3-8B: 32,768 x 4, as Qwen
    documents), linear scaling the config's length."""
    qwen = preset_config("qwen3-8b")
    assert model_positions(qwen).tokens == qwen.max_position_embeddings
    llama = preset_config("llama-3.1-8b")
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert model_positions(llama).tokens == llama.max_position_embeddings
    yarn = model_positions(with_rope_scaling(qwen, parse_rope_scaling("yarn:4:32768")))
    assert yarn.tokens == 4 * 32768 and "yarn factor 4" in yarn.source
    linear = model_positions(with_rope_scaling(qwen, parse_rope_scaling("linear:2")))
    assert linear.tokens == 2 * qwen.max_position_embeddings
    assert qwen.rope_parameters["rope_type"] == "default"  # the preset itself is untouched


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--rope-scaling", "ntk:4"], "give TYPE:FACTOR[:ORIGINAL_POSITIONS] with TYPE one of yarn, linear, dynamic"),
        (["--rope-scaling", "yarn:0.5"], "the factor must be above 1"),
        (["--rope-scaling", "yarn:four"], "the factor 'four' is not a number"),
        (["--rope-scaling", "yarn:4:-1"], "the original positions '-1' are not a positive whole number"),
        (["--trainer", "grpo", "--vllm-max-model-length", "4096"],
         "argument --vllm-max-model-length: configures vLLM: give --use-vllm too"),
        (["--trainer", "grpo", "--use-vllm", "--vllm-max-model-length", "0"], "vllm-max-model-length must be >= 1"),
    ],
)  # fmt: skip
def test_bad_limits_are_named(capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "tiny", *args])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_a_max_model_len_past_the_positions_is_refused_in_vllms_words(capsys, monkeypatch):
    """vLLM refuses a max_model_len above the one it derives (without VLLM_ALLOW_LONG_MAX_MODEL_LEN):
    refused before anything is simulated."""

    def simulated(*_args, **_kwargs):
        raise AssertionError("simulated before the refusal")

    monkeypatch.setattr("hf_offload.tools.estimate.Simulator", simulated)
    with pytest.raises(SystemExit):
        main(["estimate", *GRPO_TINY, "--use-vllm", "--vllm-max-model-length", "4096"])
    err = capsys.readouterr().err
    assert "User-specified max_model_len (4096) is greater than the derived max_model_len" in err
    assert "max_position_embeddings 2,048" in err and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in err


def test_vllm_answers_stop_at_max_model_len(capsys, monkeypatch):
    """With memory for far longer rows, vLLM's answer is its max_model_len less the prompt: derived
    from the model's positions, or as given; without the cap the answer runs past the positions."""
    derived = estimate_json(capsys, *GRPO_TINY, "--use-vllm")["modes"]["checkpointing"]
    assert derived["max_seq_len"] == 2048 - 64
    assert "max_position_embeddings 2,048" in derived["generation"]["limited_by"]
    given = estimate_json(capsys, *GRPO_TINY, "--use-vllm", "--vllm-max-model-length", "1088")
    assert given["modes"]["checkpointing"]["max_seq_len"] == 1088 - 64
    assert "vllm_max_model_length 1,088" in given["modes"]["checkpointing"]["generation"]["limited_by"]
    monkeypatch.setattr(grpo_generation.GenerationPlan, "length_cap", lambda self: (None, ""))
    uncapped = estimate_json(capsys, *GRPO_TINY, "--use-vllm")["modes"]["checkpointing"]
    assert uncapped["generation"]["max_seq_len_generation"] > 2048


def test_generate_stops_at_the_positions_with_the_rope_scaling_given(capsys):
    """transformers' generate does not stop at the positions (TRL generates to max_completion_length):
    the answer does, and says so; YaRN given on the command line stretches them."""
    scaled = estimate_json(capsys, *GRPO_TINY, "--rope-scaling", "yarn:2")["modes"]["checkpointing"]
    assert scaled["max_seq_len"] == 2 * 2048 - 64
    reason = scaled["generation"]["limited_by"]
    assert "original_max_position_embeddings 2,048 x yarn factor 2 = 4,096" in reason
    assert "TRL's generate does not stop there" in reason


def test_none_fits_beside_vllms_share_names_it_and_sleep_mode(capsys, monkeypatch):
    """At vllm_gpu_memory_utilization 0.9 without sleep mode vLLM's share stays during the step
    and leaves it too little: "none fits" says that the share took the memory and that sleep mode
    gives it back (all but what asleep vLLM keeps)."""
    from test_estimate import simulate_once

    args = ["--preset", "tiny", "--trainer", "grpo", "--num-generations", "2", "--modes", "checkpointing",
            "--granularity", "256", "--prompt-length", "64", "--device-memory", "13.6", "--use-vllm",
            "--vllm-gpu-memory-utilization", "0.9", "--reserve", "allocator=0"]  # fmt: skip
    simulate_once(monkeypatch)
    result = estimate_json(capsys, *args)["modes"]["checkpointing"]
    share = result["generation"]["vllm"]
    assert result["max_seq_len"] is None
    words = result["max_seq"]["none_fits"]["vllm_during_step"]
    assert f"vLLM's share ({share['share_bytes'] / 2**30:.2f} GiB: vllm_gpu_memory_utilization 0.9" in words
    assert f"sleep mode (--vllm-enable-sleep-mode, GRPOConfig.vllm_enable_sleep_mode) gives back all but " \
           f"{share['asleep_bytes'] / 2**30:.2f} GiB" in words  # fmt: skip
    assert main(["estimate", *args]) == 0
    assert words in capsys.readouterr().out


@pytest.mark.parametrize("version", ["0.21.9", "0.22.0", "0.31.0", "0.31.1"])
def test_the_vllm_range_is_trls_own(monkeypatch, version):
    """--vllm-version takes what TRL 1.16's own check accepts without a warning, and refuses the rest."""
    import importlib
    import warnings

    from hf_offload.tools.generation_limits import check_vllm_version

    import_utils = importlib.import_module("trl.import_utils")
    monkeypatch.setattr(import_utils, "_is_package_available", lambda *_a, **_k: (True, version))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert import_utils.is_vllm_available()
    trl_accepts = not any("TRL currently supports vLLM versions" in str(w.message) for w in caught)
    if trl_accepts:
        assert check_vllm_version(version) == version
    else:
        with pytest.raises(ValueError, match="TRL 1.16 supports vLLM versions from 0.22.0 to 0.31.0"):
            check_vllm_version(version)


def test_a_four_bit_policy_with_colocated_vllm_is_refused_where_vllm_cannot_load_it(capsys, monkeypatch):
    """TRL passes quantization="bitsandbytes" for a 4-bit policy; on a vLLM without it (the default,
    the newest TRL accepts) that does not start: refused before the model loads, in TRL's and vLLM's
    words. An older release is taken, and the answer names the releases it assumes."""

    def loaded(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the refusal")

    qlora = ["--preset", "tiny", "--lora-rank", "4", "--load-in-4bit", "--trainer", "grpo", "--num-generations", "2",
             "--modes", "checkpointing", "--use-vllm", "--seq-len", "256", "--optimizer-states", "0"]  # fmt: skip
    with monkeypatch.context() as patched:
        patched.setattr("hf_offload.tools.presets.preset_config", loaded)
        with pytest.raises(SystemExit):
            main(["estimate", *qlora])
    err = capsys.readouterr().err
    assert 'LLM(..., quantization="bitsandbytes")' in err
    assert 'vLLM 0.31.0 answers "Unknown quantization method: bitsandbytes"' in err and "--vllm-version" in err
    result = estimate_json(capsys, *qlora, "--vllm-version", "0.30")
    releases = result["modes"]["checkpointing"]["generation"]["vllm_releases"]
    assert releases.startswith("vLLM 0.22.0 up to before 0.31.0") and "--vllm-version 0.30.0" in releases


def test_a_four_bit_policys_weight_sync_crosses_the_host_twice():
    """TRL's sync of a 4-bit policy merges and unmerges the adapters, and PEFT re-quantizes each
    merged 4-bit weight from a CPU copy: every 4-bit weight crosses to the host and back in bf16,
    twice; a bf16 policy's merge stays on the GPU (no host term)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_offload.tools.grpo_generation import PAGEABLE_GBPS, four_bit_merge_seconds
    from hf_offload.tools.simulator import Simulator, Training, TrlStep
    from hf_offload.tools.simulator.four_bit import FourBit

    config = preset_config("tiny")
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for name, m in plain.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head")  # fmt: skip
    qlora = Simulator(config, Training(lora_rank=4, four_bit=FourBit("nf4", True, torch.bfloat16),
                                       trl=TrlStep("grpo")))  # fmt: skip
    assert four_bit_merge_seconds(qlora) == pytest.approx(4 * linear * 2 / (PAGEABLE_GBPS * 1e9))
    assert four_bit_merge_seconds(Simulator(config, Training(lora_rank=4, trl=TrlStep("grpo")))) == 0
