"""Train a model twice, without and with activation offloading, and show that nothing changed.

The two runs start from the same weights and see the same batches, so any difference in the
losses (or final weights) would be the offloader's fault: a correct offloader hands autograd
back exactly the bytes it took, and the results are bit-identical.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

LEARNING_RATE = 1e-3

# Small enough to train a few steps in seconds on two CPU cores, yet a real Llama (grouped-query
# attention, RoPE, SwiGLU), so the engine sees the same saved tensors a full-size model makes.
TINY_LLAMA_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}


def build_tiny_llama(seed: int) -> PreTrainedModel:
    """A randomly initialised tiny Llama; seeded so that every demo run starts from the same weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))


def load_local_model(path: str | Path) -> PreTrainedModel:
    """A model from a local directory. `local_files_only` because a typo must not become a download."""
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


@dataclass
class RunResult:
    losses: list[torch.Tensor] = field(default_factory=list)
    final_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    peak_memory_bytes: int | None = None


def make_batches(*, steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    # A generator of its own, on the CPU, so the batches do not depend on the device or on how
    # much of the global random stream model construction consumed.
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (batch_size, seq_len), generator=generator) for _ in range(steps)]


def snapshot_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # A deep copy kept in host memory: a second copy of the weights on the accelerator would
    # count towards both runs' peak memory and could not fit for large models.
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}


def train(model: PreTrainedModel, batches: list[torch.Tensor], *, device: torch.device, seed: int) -> RunResult:
    result = RunResult()
    # Reseeded per run so that dropout, in models that use it, draws the same masks in both runs.
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for batch in batches:
        input_ids = batch.to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.detach().to("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    result.final_weights = snapshot_weights(model)
    # Dropped before the next run so that it starts with the same memory in use as this one.
    del optimizer
    return result


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """Make the accelerator's kernels reproducible, so that differences can only come from offloading.

    Some CUDA kernels (cuBLAS with its default workspace, attention backward) accumulate in an
    order that varies between runs; then even two runs without offloading would differ.
    """
    if device.type == "cpu":
        yield
        return
    # Read by cuBLAS when its first handle is made, which is still ahead for a fresh process.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    # warn_only: an op without a deterministic version should explain a mismatch, not stop the demo.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)


def run_demo(
    model: PreTrainedModel,
    *,
    steps: int = 3,
    seq_len: int = 256,
    batch_size: int = 2,
    device: str | torch.device = "cpu",
    seed: int = 0,
    echo: Callable[[str], object] = print,
) -> int:
    """Train `model` for `steps` steps without and then with offloading; 0 if both runs match bit for bit."""
    device = torch.device(device)
    model.to(device)
    batches = make_batches(
        steps=steps, batch_size=batch_size, seq_len=seq_len, vocab_size=model.config.vocab_size, seed=seed
    )
    simulate_on_cpu = device.type == "cpu"
    parameter_count = sum(parameter.numel() for parameter in model.parameters())
    echo(
        f"{type(model).__name__}, {parameter_count / 1e6:.1f}M parameters, on {device}: "
        f"{steps} step(s) of {batch_size} x {seq_len} tokens, AdamW lr {LEARNING_RATE:g}"
    )
    if simulate_on_cpu:
        echo(
            "CPU simulation: the real offload engine runs (simulate_on_cpu=True), but its copies "
            "stay in host memory, so it saves no memory."
        )

    initial_weights = snapshot_weights(model)
    with deterministic_kernels(device):
        plain = train(model, batches, device=device, seed=seed)
        model.load_state_dict(initial_weights)
        model.enable_activation_offloading(simulate_on_cpu=simulate_on_cpu)
        try:
            offloaded = train(model, batches, device=device, seed=seed)
            stats = model.activation_offloading_stats()
        finally:
            model.disable_activation_offloading()

    losses_identical = all(map(torch.equal, plain.losses, offloaded.losses))
    weights_identical = all(
        torch.equal(tensor, offloaded.final_weights[name]) for name, tensor in plain.final_weights.items()
    )
    echo(f"{'step':>4}  {'loss, plain':>14}  {'loss, offloaded':>15}")
    for step, (plain_loss, offloaded_loss) in enumerate(zip(plain.losses, offloaded.losses, strict=True), start=1):
        echo(f"{step:>4}  {plain_loss.item():>14.8f}  {offloaded_loss.item():>15.8f}")
    echo(f"bit-identical: losses {_yes_no(losses_identical)}, final weights {_yes_no(weights_identical)}")
    echo("offloading in the last step:")
    for line in stats.summary().splitlines():
        echo(f"  {line}")
    if plain.peak_memory_bytes is not None and offloaded.peak_memory_bytes is not None:
        ratio = offloaded.peak_memory_bytes / plain.peak_memory_bytes
        echo(
            f"peak {device.type} memory: plain {_gib(plain.peak_memory_bytes)}, "
            f"offloaded {_gib(offloaded.peak_memory_bytes)} ({ratio:.2f}x)"
        )
    return 0 if losses_identical and weights_identical else 1


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
