"""Train a model twice, without and with activation offloading, and show that nothing changed.

The two runs start from the same weights and see the same batches, so on kernels that repeat
bit for bit any difference in the losses (or final weights) would be the offloader's fault: a
correct offloader hands autograd back exactly the bytes it took, and the results are
bit-identical. CPU kernels repeat; on an accelerator `hf_offload.determinism` makes them repeat
where PyTorch can, and the verdict says "cannot tell" where it could not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from .determinism import DeterministicKernels, losses_and_weights_verdict, same_tensors

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


def run_demo(
    model: PreTrainedModel,
    *,
    steps: int = 3,
    seq_len: int = 256,
    batch_size: int = 2,
    device: str | torch.device = "cpu",
    seed: int = 0,
    control: bool = False,
    kernels: DeterministicKernels | None = None,
    echo: Callable[[str], object] = print,
) -> int:
    """Train `model` for `steps` steps without and then with offloading.

    Returns 0 if both runs match bit for bit, 1 if they differ on deterministic kernels, 3 if they
    differ and the kernels were not deterministic (then nobody can tell whether offloading did it).
    On an accelerator `model` is switched to eager attention. `control` adds a second run without
    offloading, which must match the first. Pass `kernels` made before any CUDA work in the
    process; made here, it is too late if the caller has already used CUDA (and then says so).
    """
    device = torch.device(device)
    if kernels is None:
        kernels = DeterministicKernels(device)
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
    kernels.prepare(model)
    echo(kernels.describe())

    initial_weights = snapshot_weights(model)
    with kernels:
        plain = train(model, batches, device=device, seed=seed)
        if control:
            model.load_state_dict(initial_weights)
            again = train(model, batches, device=device, seed=seed)
            kernels.note_control(_same_run(plain, again))
        model.load_state_dict(initial_weights)
        model.enable_activation_offloading(simulate_on_cpu=simulate_on_cpu)
        try:
            offloaded = train(model, batches, device=device, seed=seed)
            stats = model.activation_offloading_stats()
        finally:
            model.disable_activation_offloading()

    echo(f"{'step':>4}  {'loss, plain':>14}  {'loss, offloaded':>15}")
    for step, (plain_loss, offloaded_loss) in enumerate(zip(plain.losses, offloaded.losses, strict=True), start=1):
        echo(f"{step:>4}  {plain_loss.item():>14.8f}  {offloaded_loss.item():>15.8f}")
    if (control_line := kernels.describe_control()) is not None:
        echo(control_line)
    verdict, line = losses_and_weights_verdict(
        same_tensors(plain.losses, offloaded.losses), _same_weights(plain, offloaded), kernels.reasons
    )
    echo(line)
    echo("offloading in the last step:")
    for line in stats.summary().splitlines():
        echo(f"  {line}")
    if plain.peak_memory_bytes is not None and offloaded.peak_memory_bytes is not None:
        ratio = offloaded.peak_memory_bytes / plain.peak_memory_bytes
        echo(
            f"peak {device.type} memory: plain {_gib(plain.peak_memory_bytes)}, "
            f"offloaded {_gib(offloaded.peak_memory_bytes)} ({ratio:.2f}x)"
        )
    return verdict.exit_code


def _same_weights(first: RunResult, second: RunResult) -> bool:
    return same_tensors(first.final_weights.values(), (second.final_weights[name] for name in first.final_weights))


def _same_run(first: RunResult, second: RunResult) -> bool:
    return same_tensors(first.losses, second.losses) and _same_weights(first, second)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
