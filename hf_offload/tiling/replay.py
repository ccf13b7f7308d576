"""When tiling splits a call, and what a tiled call's slices ran under in forward, so that backward
recomputes each slice the way it first ran: the autocast state, and the random state at the start
of each slice where the slices drew random numbers (dropout, LoRA dropout, router jitter).

Two rules decide whether a call is split, each with its reason: `splits` for the decoder layers'
parts (training mode), `tiles_loss` for the loss head (training with grad). Neither splits in eval
mode, and a forward with grad there is said once per model (`say_eval_mode_runs_whole`).

A random state is kept only where something random ran: after each slice the generators are read
again, and a slice that left them as they were shares its predecessor's record. A call whose
slices drew nothing keeps nothing, and backward then forks no generator. (A state per slice of
every tiled module would cost ~5 KB of host memory each: about 0.3 GB per step at 1M tokens.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

logger = logging.getLogger("hf_offload")


def splits(module: nn.Module) -> bool:
    """Whether tiling runs a call of a decoder layer's part (a per-token module, attention over
    heads) in pieces: when the module is training, grad on or off (not in inference mode).

    Not "training with grad enabled": a reentrant checkpoint runs the layer's first forward under
    no_grad and its recompute with grad, so such a rule ran the call whole in the forward that
    reports the loss and in pieces in the recompute that gives the gradient. Where the pieces draw
    random numbers (attention dropout per group of heads, LoRA dropout per slice), the two passes
    drew different masks, and the gradient was that of another loss. Training mode is the same in
    both passes. Eval mode stays whole: a module in eval mode reads a call without grad as
    inference (bitsandbytes' 4-bit layers on a CPU with AVX512-BF16 repack their weight in place
    for it), so no piece of it runs there under no_grad. Nor under inference mode, which no
    checkpoint's pass runs under: its tensors have no version counter for a tiled module to read
    (training-mode generation under `torch.inference_mode()`)."""
    return module.training and not torch.is_inference_mode_enabled()


def tiles_loss(model: nn.Module) -> bool:
    """Whether the loss head (our tiled one, or the notice that TRL's fused head is in use) acts on
    a forward of `model`: in training with grad on. Not `splits`: the loss head runs outside the
    layers' checkpoints, so no pass of it runs under no_grad to be recomputed with grad, and a
    training-mode forward under no_grad (a reference model's log-probabilities, an evaluation
    without model.eval()) wants `outputs.logits`, which the tiled loss does not return."""
    return model.training and torch.is_grad_enabled()


def eval_mode_with_grad(module: nn.Module) -> bool:
    """A forward that may be backpropagated, run in eval mode (to turn dropout off, say), where
    neither rule splits."""
    return not module.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def say_eval_mode_runs_whole(module: nn.Module, said: set) -> None:
    """Once per model (`said`, shared by its tiled modules): sequence tiling did not split a forward
    with grad in eval mode, so that step holds what tiling saves in training."""
    if "eval_mode" in said:
        return
    said.add("eval_mode")
    logger.warning(
        "hf_offload: %s ran a forward with grad in eval mode, where sequence tiling runs it whole (a 4-bit "
        "layer in eval mode reads a call without grad as inference, and tiling's forward slices run without "
        "grad; transformers' checkpointing and hf_offload's offloading are off in eval mode too): this step "
        "holds what tiling saves in training. To tile it, train in training mode (model.train()), with dropout "
        "turned off in the config if that is why the model is in eval mode (attention_dropout=0.0, LoRA's "
        "lora_dropout=0.0)",
        type(module).__name__,
    )


def _autocast_state(device_type: str) -> tuple[tuple[str, bool, torch.dtype], ...]:
    states = []
    for kind in dict.fromkeys((device_type, "cpu")):
        if torch.amp.is_autocast_available(kind):
            states.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))
    return tuple(states)


def _device_module(device: torch.device):
    """The module whose get_rng_state / set_rng_state serve the device's generator (None: the
    CPU's generator is the only one, or the device has none, as the meta device)."""
    if device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device.type)
    return module if hasattr(module, "get_rng_state") else None


class Replay:
    """Started before a tiled call's first slice; `slice_done()` after each slice in forward;
    `replaying(index)` around slice `index`'s recompute in backward."""

    __slots__ = ("device", "autocast", "_device_module", "_starts", "_drew_cpu", "_drew_device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.autocast = _autocast_state(device.type)
        self._device_module = _device_module(device)
        # The generators' states at the start of each slice: (cpu, device); consecutive slices
        # that drew nothing share one tuple. None once known that no slice drew anything.
        self._starts: list[tuple] | None = [self._read()]
        self._drew_cpu = False
        self._drew_device = False

    def _read(self) -> tuple:
        device_state = self._device_module.get_rng_state(self.device) if self._device_module is not None else None
        return torch.get_rng_state(), device_state

    def slice_done(self, last: bool) -> None:
        """A slice has run: note whether it drew random numbers and, unless it was the last,
        where the next one starts."""
        start = self._starts[-1]
        now = self._read()
        drew_cpu = not torch.equal(now[0], start[0])
        drew_device = now[1] is not None and not torch.equal(now[1], start[1])
        self._drew_cpu |= drew_cpu
        self._drew_device |= drew_device
        if last:
            if not (self._drew_cpu or self._drew_device):
                self._starts = None
            return
        self._starts.append(now if (drew_cpu or drew_device) else start)

    @property
    def keeps_random_state(self) -> bool:
        return self._starts is not None

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            yield

    @contextlib.contextmanager
    def replaying(self, index: int) -> Iterator[None]:
        """Slice `index` recomputed as it ran in forward; the generators are left as they were."""
        if self._starts is None:
            with self._autocast():
                yield
            return
        cpu_state, device_state = self._starts[index]
        devices = [self.device] if self._drew_device else []
        with torch.random.fork_rng(devices=devices, enabled=True, device_type=self.device.type if devices else "cuda"):
            if self._drew_cpu:
                torch.set_rng_state(cpu_state)
            if self._drew_device:
                self._device_module.set_rng_state(device_state, self.device)
            with self._autocast():
                yield
