"""Backward of a tiled call: each slice recomputed by the module's forward, differentiated, and its
gradients put where they belong.

Gradients of the tensors the computation uses besides its input arrive once per step, as without
tiling. Two ways, by what the training setup listens to:
- Ordinary parameters (plain, DDP, FSDP2, FSDP1 with use_orig_params) are inputs of the autograd
  Function: each slice's gradients come from `torch.autograd.grad`, are summed, and the Function
  returns the sum. Each parameter's AccumulateGrad runs once, which is what DDP's reducer,
  FSDP's post-backward and gradient hooks wait for.
- DeepSpeed ZeRO-3's partitioned parameters hold no data outside their module's call, so they
  cannot be the Function's inputs (autograd checks a returned gradient against the input's shape
  at the time of the call). They follow DeepSpeed's own protocol for tiled computations: each
  slice's backward accumulates into them, with `ds_grad_is_ready` False until the last slice, so
  ZeRO-3 reduces the sum once.
FSDP1 with use_orig_params=False replaces a module's parameters by plain tensors, views of its
flat parameter, and makes new views in backward: those are found as tensor attributes and read
again, by name, when the backward runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


def _is_zero3_parameter(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


@dataclass
class Targets:
    """What a tiled computation needs gradients for besides its input, found at the forward call.

    `places` say where each tensor of `tensors` lives ((module, attribute name), or None for a
    tensor held directly), so that backward can read the current one; `zero3` are DeepSpeed
    ZeRO-3 parameters."""

    places: list[tuple[nn.Module, str] | None] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    zero3: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, module: nn.Module | None, extra: Sequence[torch.Tensor] = ()) -> Targets:
        targets = cls()
        seen: set[int] = set()

        def add(place, tensor: torch.Tensor) -> None:
            if id(tensor) in seen or not tensor.requires_grad:
                return
            seen.add(id(tensor))
            if _is_zero3_parameter(tensor):
                targets.zero3.append(tensor)
            else:
                targets.places.append(place)
                targets.tensors.append(tensor)

        for owner in module.modules() if module is not None else ():
            for name, parameter in owner._parameters.items():
                if parameter is not None:
                    add((owner, name), parameter)
            for name, value in owner.__dict__.items():
                # FSDP1 (use_orig_params=False): views of the flat parameter as plain attributes.
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    add((owner, name), value)
        for tensor in extra:
            add(None, tensor)
        return targets

    def merged(self, other: Targets) -> Targets:
        """These targets and `other`'s, each tensor once."""
        mine = {id(t) for t in (*self.tensors, *self.zero3)}
        pairs = [(p, t) for p, t in zip(other.places, other.tensors, strict=True) if id(t) not in mine]
        return Targets(
            self.places + [p for p, _ in pairs],
            self.tensors + [t for _, t in pairs],
            self.zero3 + [t for t in other.zero3 if id(t) not in mine],
        )

    def current(self) -> list[torch.Tensor]:
        """The tensors as the modules hold them now, in the order of `tensors`."""
        current = []
        for place, tensor in zip(self.places, self.tensors, strict=True):
            now = tensor if place is None else getattr(place[0], place[1], None)
            if not isinstance(now, torch.Tensor) or now.shape != tensor.shape:
                now = tensor
            current.append(now)
        return current


def refuse_double_backward(name: str) -> None:
    """Backward with create_graph=True runs with grad mode on: a tiled part's gradient is computed
    from slices recomputed apart from the graph, so it is not differentiable again."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"hf_offload: double backward (create_graph=True, e.g. a gradient penalty) through {name} under "
            "sequence tiling is not supported: its gradient is computed from slices recomputed outside the "
            "graph. Call model.disable_sequence_tiling() for this computation."
        )


Recompute = Callable[[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


def backward_by_slices(
    x: torch.Tensor,
    bounds: Sequence[tuple[int, int]],
    wants_x: bool,
    targets: Targets,
    replaying: Callable[[int], object],
    recompute: Recompute,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The gradient of `x` (batch, tokens, ...) and of `targets.tensors`, slice by slice.

    `recompute(index, leaf)` runs slice `index` again from `leaf`, its part of `x` (a fresh leaf
    tensor), and returns (output, gradient of the output) pairs; it runs under `replaying(index)`
    and with grad enabled. The input's gradient is written into one buffer, slice by slice."""
    grad_x = torch.empty_like(x) if wants_x else None
    current = targets.current()
    sums: list[torch.Tensor | None] = [None] * len(current)
    zero3 = targets.zero3
    last = len(bounds) - 1
    for index, (start, stop) in enumerate(bounds):
        with replaying(index), torch.enable_grad():
            leaf = x[:, start:stop].detach().requires_grad_(wants_x)
            pairs = [(output, grad) for output, grad in recompute(index, leaf) if output.requires_grad]
        outputs, gradients = [output for output, _ in pairs], [grad for _, grad in pairs]
        inputs = ([leaf] if wants_x else []) + current
        if zero3:
            # DeepSpeed's protocol: accumulate each slice, reduce once after the last one. The other
            # tensors (there are seldom any beside ZeRO-3's) accumulate directly too.
            for parameter in zero3:
                parameter.ds_grad_is_ready = index == last
            if pairs:
                torch.autograd.backward(outputs, gradients, inputs=inputs + zero3)
            found = [leaf.grad] if wants_x else []
            found += [None] * len(current)
        elif pairs and inputs:
            found = list(torch.autograd.grad(outputs, inputs, gradients, allow_unused=True))
        else:
            found = [None] * len(inputs)
        del outputs, gradients, pairs
        if wants_x:
            piece = found.pop(0)
            if piece is None:
                grad_x[:, start:stop].zero_()
            else:
                grad_x[:, start:stop] = piece
        for position, grad in enumerate(found):
            if grad is not None:
                sums[position] = grad if sums[position] is None else sums[position].add_(grad)
    return grad_x, sums
