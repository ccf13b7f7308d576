"""The comparison verdict is never a false NO: a difference on kernels that need not repeat says
"cannot tell", and the setup that makes them repeat (eager attention above all) really takes effect.

No CUDA here, so the accelerator setup runs on CPU models: `DeterministicKernels("cpu", needed=True)`
applies everything but the cuBLAS setting, and `DeterministicKernels("cuda")` (a device label only)
exercises the cuBLAS setting. The non-determinism warning comes from a real PyTorch op that has
no deterministic implementation on the CPU either: `Tensor.put_` with accumulate=False.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from conftest import tiny_model
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.llama import modeling_llama

from hf_offload.tools.determinism import (
    CUBLAS_WORKSPACE_VARIABLE,
    EXIT_CANNOT_TELL,
    EXIT_DIFFERENT,
    EXIT_IDENTICAL,
    DeterministicKernels,
)

# PyTorch's texts for the two alerts only CUDA raises (aten/src/ATen/Context.cpp and the flash
# attention backward), as TORCH_WARN hands them to Python's warnings.
FLASH_TEXT = (
    "Flash Attention defaults to a non-deterministic algorithm. To explicitly enable determinism call "
    "torch.use_deterministic_algorithms(True, warn_only=False)."
)
CUBLAS_TEXT = (
    "Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
    "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because it uses "
    "CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must set an "
    "environment variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 or "
    "CUBLAS_WORKSPACE_CONFIG=:16:8."
)


def op_without_deterministic_implementation() -> None:
    torch.zeros(4).put_(torch.tensor([1]), torch.tensor([1.0]))


def ready_kernels(**options) -> DeterministicKernels:
    kernels = DeterministicKernels("cpu", needed=True, **options)
    kernels.prepare(tiny_model("llama"))
    return kernels


@pytest.fixture(autouse=True)
def deterministic_mode_restored():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    after = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(*before[:1], warn_only=before[1])
    assert after == before, "DeterministicKernels left PyTorch's deterministic mode changed"


def test_flagged_op_turns_a_difference_into_cannot_tell():
    kernels = ready_kernels()
    with kernels:
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        op_without_deterministic_implementation()
    assert kernels.reasons == ("put_ has no deterministic implementation",)
    verdict = kernels.verdict(False)
    assert verdict.word == "cannot tell" and verdict.exit_code == EXIT_CANNOT_TELL
    assert str(verdict) == (
        "cannot tell (non-deterministic kernels: put_ has no deterministic implementation; "
        "a bitwise comparison needs deterministic ones)"
    )
    assert "NO" not in str(verdict)
    # Identical bits are identical, whatever the kernels.
    assert str(kernels.verdict(True)) == "yes" and kernels.verdict(True).exit_code == EXIT_IDENTICAL


def test_difference_on_deterministic_kernels_is_no():
    """The companion: without the flagged op the same difference is a NO, with its own exit status."""
    kernels = ready_kernels()
    with kernels:
        torch.zeros(4).index_put_((torch.tensor([1]),), torch.tensor([1.0]), accumulate=True)  # deterministic on CPU
    assert kernels.reasons == ()
    assert str(kernels.verdict(False)) == "NO" and kernels.verdict(False).exit_code == EXIT_DIFFERENT
    assert kernels.verdict(False).stated("losses and trained weights") == "NO (losses and trained weights)"


@pytest.mark.parametrize("action", ["ignore", "error"])
def test_flagged_op_recorded_whatever_the_warnings_filter(action):
    """A user running with -W ignore or -W error (or a library silencing UserWarning) must get
    neither a false NO nor a crash."""
    kernels = ready_kernels()
    with warnings.catch_warnings():
        warnings.simplefilter(action)
        with kernels:
            op_without_deterministic_implementation()
    assert kernels.verdict(False).word == "cannot tell"


def test_only_inside_the_block_and_other_warnings_still_shown():
    kernels = ready_kernels()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.warns(UserWarning, match="put_ does not have a deterministic implementation"):
            op_without_deterministic_implementation()  # outside the block: not the comparison's business
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.warns(UserWarning, match="unrelated"), kernels:
        warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert kernels.reasons == ()


def test_cuda_only_alerts_are_named():
    kernels = ready_kernels()
    with kernels:
        warnings.warn(FLASH_TEXT, UserWarning, stacklevel=1)
        warnings.warn(CUBLAS_TEXT, UserWarning, stacklevel=1)
        warnings.warn(FLASH_TEXT, UserWarning, stacklevel=1)  # each reason once
    assert kernels.reasons == (
        "Flash Attention used its non-deterministic algorithm",
        "cuBLAS ran without CUBLAS_WORKSPACE_CONFIG=:4096:8",
    )
    assert kernels.verdict(False).word == "cannot tell"


def test_entering_twice_is_refused():
    kernels = ready_kernels()
    with kernels, pytest.raises(RuntimeError, match="already entered"), kernels:
        pass


def test_forgotten_setup_and_failed_control_are_reasons():
    kernels = DeterministicKernels("cpu", needed=True)
    assert kernels.verdict(False).reasons == (
        "attention was not switched to eager (prepare() was not called)",
        "the runs were not inside the deterministic block",
    )
    kernels = ready_kernels()
    with kernels:
        pass
    kernels.note_control(True)
    assert kernels.verdict(False).word == "NO"
    assert kernels.describe_control() == "control, two runs without offloading: identical"
    kernels.note_control(False)
    assert kernels.verdict(False).reasons == ("two runs without offloading differ",)
    assert kernels.describe_control().startswith("control, two runs without offloading: DIFFER")


def test_cpu_needs_nothing_and_a_difference_is_no():
    model = tiny_model("llama")
    kernels = DeterministicKernels("cpu")
    kernels.prepare(model)
    with kernels:
        assert not torch.are_deterministic_algorithms_enabled()
    assert model.config._attn_implementation == "sdpa"
    assert kernels.describe() == "deterministic kernels: none needed on cpu (its kernels repeat bit for bit)"
    assert str(kernels.verdict(False)) == "NO" and str(kernels.verdict(True)) == "yes"


# ---- eager attention, really in effect ----


def plain_llama(tmp_path) -> torch.nn.Module:
    return tiny_model("llama")


def loaded_llama(tmp_path) -> torch.nn.Module:
    tiny_model("llama").save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)


def lora_llama(tmp_path) -> torch.nn.Module:
    return get_peft_model(loaded_llama(tmp_path), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts of the eager and the SDPA attention functions called by a Llama forward."""
    calls = {"eager": 0, "sdpa": 0}
    eager, sdpa = modeling_llama.eager_attention_forward, torch.nn.functional.scaled_dot_product_attention

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    # Looked up at call time: the Llama attention by its module's global, SDPA through torch.nn.functional.
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", counted("eager", eager))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted("sdpa", sdpa))
    return calls


@pytest.mark.parametrize("build", [plain_llama, loaded_llama, lora_llama])
def test_eager_attention_in_effect(build, tmp_path, attention_calls):
    model = build(tmp_path)
    ids = torch.randint(50, (1, 8))
    model(input_ids=ids)
    # The companion: before the switch the spies see SDPA, so they can tell the two apart.
    assert attention_calls == {"eager": 0, "sdpa": 3}
    kernels = DeterministicKernels("cpu", needed=True)
    assert kernels.prepare(model) is model
    configs = [module.config for module in model.modules() if isinstance(module, PreTrainedModel)]
    assert configs and all(config._attn_implementation == "eager" for config in configs)
    model(input_ids=ids)
    assert attention_calls == {"eager": 3, "sdpa": 3}
    with kernels:
        pass
    assert kernels.reasons == ()


def test_attention_that_stays_fused_is_a_reason(monkeypatch):
    # transformers refuses the switch (with a log line) for models whose attention is not written
    # against its AttentionInterface.
    monkeypatch.setattr(PreTrainedModel, "_can_set_attn_implementation", classmethod(lambda cls: False))
    model = tiny_model("llama")
    kernels = DeterministicKernels("cpu", needed=True)
    kernels.prepare(model)
    kernels.prepare(tiny_model("llama"))  # the examples prepare one model per run: one line still
    with kernels:
        pass
    assert model.config._attn_implementation == "sdpa"
    assert kernels.reasons == ("attention in LlamaForCausalLM is still sdpa, not eager",)
    assert kernels.verdict(False).word == "cannot tell"


def test_attention_switch_that_raises_is_a_reason(monkeypatch):
    def refuse(self, implementation, **options):
        raise ValueError(f"{implementation} is not supported here")

    monkeypatch.setattr(PreTrainedModel, "set_attn_implementation", refuse)
    kernels = DeterministicKernels("cpu", needed=True)
    kernels.prepare(tiny_model("llama"))
    reasons = kernels.verdict(False).reasons
    assert reasons[0] == "LlamaForCausalLM refused eager attention: eager is not supported here"
    assert "attention in LlamaForCausalLM is still sdpa, not eager" in reasons


def test_a_model_without_transformers_attention_is_a_reason():
    kernels = DeterministicKernels("cpu", needed=True)
    kernels.prepare(torch.nn.Linear(2, 2))
    with kernels:
        pass
    assert kernels.reasons == ("Linear holds no transformers model to switch to eager attention",)


# ---- CUBLAS_WORKSPACE_CONFIG ----


@pytest.fixture
def no_cublas_setting(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_VARIABLE, "placeholder")  # so that monkeypatch restores the original
    monkeypatch.delenv(CUBLAS_WORKSPACE_VARIABLE)


def test_cublas_workspace_set_for_cuda(no_cublas_setting):
    kernels = DeterministicKernels("cuda")
    assert os.environ[CUBLAS_WORKSPACE_VARIABLE] == ":4096:8"
    kernels.prepare(tiny_model("llama"))
    with kernels:
        pass
    assert kernels.reasons == ()
    assert kernels.describe() == (
        "deterministic kernels: eager attention, torch.use_deterministic_algorithms(True, warn_only=True), "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8"
    )


def test_cublas_workspace_set_too_late_is_a_reason(no_cublas_setting, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    kernels = DeterministicKernels("cuda")
    assert kernels.verdict(False).reasons[0] == (
        "CUBLAS_WORKSPACE_CONFIG was set after CUDA had started (set it before any CUDA work)"
    )


@pytest.mark.parametrize(("value", "reasons"), [(":16:8", ()), (":0:0", ("CUBLAS_WORKSPACE_CONFIG=:0:0 is not one",))])
def test_users_cublas_workspace_kept(value, reasons, monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_VARIABLE, value)
    kernels = DeterministicKernels("cuda")
    kernels.prepare(tiny_model("llama"))
    with kernels:
        pass
    assert os.environ[CUBLAS_WORKSPACE_VARIABLE] == value
    assert kernels.describe().endswith(f"CUBLAS_WORKSPACE_CONFIG={value}")
    assert len(kernels.reasons) == len(reasons)
    assert all(reason.startswith(prefix) for reason, prefix in zip(kernels.reasons, reasons, strict=True))
