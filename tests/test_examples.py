"""The demo and the examples run, and the demo's verdict is right: yes for identical runs, NO for a
real difference on deterministic kernels, "cannot tell" (never NO) when a kernel without a
deterministic implementation ran."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import run_example, tiny_model

import hf_offload
from hf_offload.tools.cli import main
from hf_offload.tools.demo import run_demo
from hf_offload.tools.determinism import EXIT_CANNOT_TELL, EXIT_DIFFERENT, DeterministicKernels

ACCELERATOR_SETUP = "deterministic kernels: eager attention, torch.use_deterministic_algorithms(True, warn_only=True)"


def test_demo_reports_bit_identical_runs(capsys):
    assert main(["demo", "--steps", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "deterministic kernels: none needed on cpu" in out
    assert "bit-identical: losses yes, final weights yes" in out
    assert "offloaded:" in out and "CPU simulation" in out


def test_demo_rejects_bad_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--steps", "0"])
    assert exit_.value.code == 2
    assert "steps must be >= 1, got 0" in capsys.readouterr().err


def demo(model, kernels=None, **options) -> tuple[int, str]:
    lines = []
    code = run_demo(model, steps=2, seq_len=12, kernels=kernels, echo=lines.append, **options)
    return code, "\n".join(lines)


def test_demo_with_the_accelerator_setup():
    """What the demo does on an accelerator, applied to the CPU: eager attention and PyTorch's
    deterministic mode around the offloaded run, the control, and no op of a Llama training step
    flagged as non-deterministic."""
    model = tiny_model("llama")
    code, out = demo(model, DeterministicKernels("cpu", needed=True), control=True)
    assert code == 0, out
    assert ACCELERATOR_SETUP in out
    assert "control, two runs without offloading: identical" in out
    assert "bit-identical: losses yes, final weights yes" in out
    assert model.config._attn_implementation == "eager"
    assert not torch.are_deterministic_algorithms_enabled()


def perturb_offloaded_run(model, *, flagged_op: bool) -> None:
    """A fault for the verdict to find: the offloaded run's logits grow by 0.1%. `flagged_op` also
    runs an op PyTorch flags as having no deterministic implementation (Tensor.put_), in every run."""

    def hook(module, inputs, output):
        if flagged_op:
            torch.zeros(2).put_(torch.tensor([0]), torch.tensor([1.0]))
        if hf_offload.is_activation_offloading(model):
            return output * 1.001
        return output

    model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("kernels", [None, "accelerator setup"])
def test_demo_says_no_to_a_real_difference(kernels):
    model = tiny_model("llama")
    perturb_offloaded_run(model, flagged_op=False)
    code, out = demo(model, None if kernels is None else DeterministicKernels("cpu", needed=True))
    assert code == EXIT_DIFFERENT, out
    assert "bit-identical: losses NO, final weights NO\n" in out


def test_demo_cannot_tell_when_a_kernel_is_not_deterministic():
    """The companion: the same difference with a flagged op in the runs is not a NO."""
    model = tiny_model("llama")
    perturb_offloaded_run(model, flagged_op=True)
    code, out = demo(model, DeterministicKernels("cpu", needed=True))
    assert code == EXIT_CANNOT_TELL, out
    assert (
        "bit-identical: losses cannot tell, final weights cannot tell (non-deterministic kernels: put_ has no "
        "deterministic implementation; a bitwise comparison needs deterministic ones)"
    ) in out
    assert "NO" not in out


def test_demo_identical_runs_are_yes_even_with_a_flagged_op():
    model = tiny_model("llama")

    def hook(*_) -> None:
        torch.zeros(2).put_(torch.tensor([0]), torch.tensor([1.0]))

    model.lm_head.register_forward_hook(hook)
    code, out = demo(model, DeterministicKernels("cpu", needed=True))
    assert code == 0, out
    assert "bit-identical: losses yes, final weights yes" in out


def test_own_loop_example_runs():
    result = run_example("own_loop.py", "--steps", "2", "--seq-len", "32")
    assert result.returncode == 0, result.stderr
    assert "step 1: loss" in result.stdout and "offloaded:" in result.stdout


def test_accelerate_example_control():
    """--control: the example trains twice without offloading and says both runs match."""
    result = run_example("accelerate_loop.py", "--steps", "2", "--seq-len", "16", "--control")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "deterministic kernels: none needed on cpu" in result.stdout
    assert "control, two runs without offloading: identical" in result.stdout
    assert "bit-identical: losses yes, final weights yes" in result.stdout


# ---- on CUDA: the checks issue 10 asks for, each in a fresh process (CUBLAS_WORKSPACE_CONFIG is
# read at the first cuBLAS call); skipped without CUDA ----

on_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA_SETUP = ACCELERATOR_SETUP + ", CUBLAS_WORKSPACE_CONFIG=:4096:8"


@on_cuda[0]
@on_cuda[1]
def test_demo_on_cuda_is_identical_with_its_control():
    command = [sys.executable, "-m", "hf_offload.tools.cli", "demo", "--device", "cuda", "--steps", "3", "--control"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert CUDA_SETUP in result.stdout
    assert "control, two runs without offloading: identical" in result.stdout
    assert "bit-identical: losses yes, final weights yes" in result.stdout


@pytest.mark.parametrize(
    ("script", "args", "verdict"),
    [
        pytest.param(
            "trainer_lora.py",
            ["--seq-len", "2048", "--batch-size", "2", "--steps", "4"],
            "identical to the run without offloading: yes",
            marks=on_cuda,
        ),
        pytest.param(
            "trl_sft.py", ["--steps", "3", "--lora"], "identical to the run without offloading: yes", marks=on_cuda
        ),
        pytest.param(
            "accelerate_loop.py",
            ["--steps", "3", "--seq-len", "512"],
            "bit-identical: losses yes, final weights yes",
            marks=on_cuda,
        ),
    ],
)
def test_examples_on_cuda_are_identical_with_their_control(script, args, verdict):
    result = run_example(script, *args, "--control")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert CUDA_SETUP in result.stdout
    assert "control, two runs without offloading: identical" in result.stdout
    assert verdict in result.stdout
