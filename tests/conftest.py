"""Tiny models of each supported family, and the training step every parity test runs."""

from __future__ import annotations

import copy
import gc
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_offload
from hf_offload.tools.determinism import DeterministicKernels

VOCAB = 97
SEQ = 12
BATCH = 2

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)

# Every built-in adapter must appear here (tests/test_adapters.py checks it).
TINY_CONFIGS = {
    "llama": dict(_COMMON),
    "qwen2": dict(_COMMON),
    "mistral": dict(_COMMON),
    "gemma": dict(_COMMON),
}


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**TINY_CONFIGS.get(model_type, _COMMON), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def batch(seed: int = 1, batch_size: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq), generator=generator)


class RandomTokens(torch.utils.data.Dataset):
    """`count` single-sequence examples of random tokens (labels = inputs), for Trainer tests."""

    def __init__(self, count: int, seed: int) -> None:
        self.ids = [batch(seed=seed + i, batch_size=1)[0] for i in range(count)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    loss.backward()
    return loss.detach(), grads(model)


def directional_derivatives(model: torch.nn.Module, inputs: dict, seed: int = 5, epsilon: float = 1e-3):
    """(analytic, central finite difference) of the loss `model(**inputs)` reports, along the unit
    direction of its own gradient, the random state reseeded before every forward (so that
    dropout draws the same masks each time); the forwards run with grad on, as in training.

    Along its own direction a gradient g gives the largest derivative, |g|, far above the float32
    rounding of the loss (transformers computes the loss, and many models their norms, in
    float32); a wrong g (one slice's dropout masks redrawn in backward, say) is not the true
    gradient, and the loss does not change at |g| along it."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(**inputs).loss.backward()
    gradients = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in trainable]
    analytic = sum(float(g.square().sum()) for g in gradients) ** 0.5
    direction = [g / analytic for g in gradients]

    def loss_at(shift: float) -> float:
        with torch.no_grad():
            for p, d in zip(trainable, direction, strict=True):
                p.add_(d, alpha=shift)
        torch.manual_seed(seed)
        loss = model(**inputs).loss.item()
        with torch.no_grad():
            for p, d in zip(trainable, direction, strict=True):
                p.sub_(d, alpha=shift)
        return loss

    difference = (loss_at(epsilon) - loss_at(-epsilon)) / (2 * epsilon)
    return analytic, difference


def assert_bit_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    assert expected, "no gradients were produced"
    differing = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not differing, f"gradients differ for {differing[:5]}"


def assert_same_step(plain: torch.nn.Module, model: torch.nn.Module, ids: torch.Tensor, where: str = "") -> None:
    """One training step of each on `ids`: bit-identical losses and gradients."""
    expected_loss, expected = train_step(plain, ids)
    loss, actual = train_step(model, ids)
    assert torch.equal(expected_loss, loss), f"losses differ {where}".strip()
    assert_bit_identical(expected, actual)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run examples/<script> as a user would, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def quiet_training_args(output_dir, **overrides) -> dict:
    """Keyword arguments for a short, seeded, CPU-only TrainingArguments (or TRL config) run
    that logs every step and writes nothing but what a test asks for."""
    return {
        "output_dir": str(output_dir),
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "data_seed": 0,
        "disable_tqdm": True,
        **overrides,
    }


def enable_sim(model: torch.nn.Module, **options) -> None:
    """Offloading with the engine really running on CPU tensors."""
    hf_offload.enable_activation_offloading(model, **{"simulate_on_cpu": True, "min_offload_bytes": 0, **options})


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def collect() -> None:
    gc.collect()


@pytest.fixture
def quiet_simulation():
    """For tests that simulate steps on tiny configs (pytestmark = usefixtures("quiet_simulation")):
    transformers' warnings about the tiny sizes, and the ones the simulation meets on purpose
    (checkpointing turning the cache off, the CPU without an accelerator), kept out of the report."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps its state in process-wide singletons; a test using it starts from none
    (what accelerate's own test case does between tests) and leaves none behind."""
    from accelerate.state import AcceleratorState, GradientState

    environ = dict(os.environ)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def deterministic_cuda_kernels():
    """For the GPU parity tests: without it, cuBLAS and attention backward may reduce in a
    different order from run to run, and two runs without offloading would already differ."""
    with DeterministicKernels("cuda", needed=True) as kernels:
        yield kernels


def cuda_peak_bytes(step, model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The most device memory allocated during `step(model, ids)`."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(model, ids)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@pytest.fixture(params=sorted(TINY_CONFIGS))
def model_type(request) -> str:
    return request.param



def pytest_terminal_summary(terminalreporter) -> None:
    """Each run ends naming the libraries installed at a version the upstream inventory was not
    checked on (docs/upstream.md): a new release, whose breaks the tests above would show."""
    from hf_offload.integrations.upstream import unchecked_versions

    new = unchecked_versions()
    if not new:
        terminalreporter.write_line("upstream: every library at a version the inventory was checked on")
        return
    listed = ", ".join(f"{library} {version}" for library, version in sorted(new.items()))
    terminalreporter.write_line(f"upstream: not yet checked against {listed} (docs/upstream.md: re-check them)")
