"""A per-token module (a decoder layer's MLP, its norms, its attention's projections), run one
slice of the sequence at a time.

The module is per token, so its output for a slice of tokens depends on those tokens only. In
forward the slices run under no_grad and only the module's input is saved; in backward each
slice is recomputed with grad and differentiated with `torch.autograd.grad`, and the parameters'
gradients are summed over the slices and returned once. The intermediate activations of one
slice exist at a time. (Returned once, not accumulated per slice into `.grad`: each parameter's
AccumulateGrad runs once per step, as without tiling, so DDP's reducer and FSDP2's post-backward
see one gradient, and hooks on gradients fire as they would.)

It wraps the module's own current forward on the instance, so whatever the module is runs
unchanged: transformers' gated MLP, one with LoRA or DoRA adapters, Liger's SwiGLU forward, an
MoE block, a LoRA'd projection with its float32 adapters (whose float32 copies of their input
then exist for one slice). MoE routers record their logits through transformers' output
capturing, once per call: the slices' records are taken out and one record for all tokens,
reassembled in token order and differentiable, is put back, so `outputs.router_logits` and the
load-balancing loss are as without tiling.
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..integrations.transformers_outputs import active_collector, collecting

logger = logging.getLogger("hf_offload")

STATE_ATTR = "_hf_offload_tiled"
PROJECTIONS_ATTR = "_hf_offload_tiled_projections"

_SEQ, _TOKENS = "seq", "tokens"  # output layouts: (batch, tokens, ...) or (batch x tokens, ...)


class _Untileable(Exception):
    """The MLP's outputs cannot be put together from slices: it runs untiled."""


@dataclass
class _Slot:
    """What tiling keeps on a module it tiles."""

    tile_tokens: int
    previous_forward: object  # an instance-level forward that was there before (None: the class's)
    untileable: str | None = None  # why it runs untiled, once found

    def forward_of(self, module: nn.Module):
        if self.previous_forward is not None:
            return self.previous_forward
        return types.MethodType(type(module).forward, module)


def _layout(tensor: torch.Tensor, batch: int, tokens: int) -> str:
    if tensor.dim() >= 2 and tensor.shape[0] == batch and tensor.shape[1] == tokens:
        return _SEQ
    if tensor.dim() >= 1 and tensor.shape[0] == batch * tokens:
        return _TOKENS
    shape = tuple(tensor.shape)
    raise _Untileable(f"an output of shape {shape} is neither (batch, tokens, ...) nor (batch x tokens, ...)")


def _join(parts: list[torch.Tensor], layout: str, batch: int) -> torch.Tensor:
    if layout == _SEQ:
        return torch.cat(parts, dim=1)
    rows = [part.view(batch, -1, *part.shape[1:]) for part in parts]
    joined = torch.cat(rows, dim=1)
    return joined.view(-1, *joined.shape[2:])


def _tile_of(tensor: torch.Tensor, layout: str, batch: int, start: int, stop: int) -> torch.Tensor:
    if layout == _SEQ:
        return tensor[:, start:stop]
    rows = tensor.view(batch, -1, *tensor.shape[1:])[:, start:stop]
    return rows.reshape(-1, *tensor.shape[1:])


class _Structure:
    """How to rebuild the MLP's output (a tensor, or a tuple of tensors and other values) from
    the tensors the autograd Function returns."""

    def __init__(self, output) -> None:
        self.is_tuple = isinstance(output, (tuple, list))
        items = list(output) if self.is_tuple else [output]
        self.kind = type(output) if self.is_tuple else None
        self.tensor_positions = [i for i, item in enumerate(items) if isinstance(item, torch.Tensor)]
        self.constants = {i: item for i, item in enumerate(items) if not isinstance(item, torch.Tensor)}
        self.size = len(items)

    def tensors(self, output) -> list[torch.Tensor]:
        items = list(output) if self.is_tuple else [output]
        if len(items) != self.size:
            raise _Untileable("the MLP returned outputs of different structure for different slices")
        return [items[i] for i in self.tensor_positions]

    def rebuild(self, tensors):
        if not self.is_tuple:
            return tensors[0]
        items = [None] * self.size
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            items[position] = tensor
        for position, value in self.constants.items():
            items[position] = value
        return self.kind(items) if self.kind is not list else items


@dataclass
class _Run:
    """One tiled call: everything the Function's backward needs to recompute a slice exactly."""

    forward: object
    batch: int
    bounds: list[tuple[int, int]]
    structure: _Structure
    layouts: list[str]  # of the MLP's tensor outputs
    recorded: list[tuple[str, int, str]]  # (collector key, entry index, layout) of records put back
    rng_states: list[tuple[torch.Tensor, object]]
    autocast: list[tuple[str, bool, torch.dtype]]
    outputs: list[torch.Tensor] | None = None  # computed before the Function, returned by it
    differentiable: list[bool] = field(default_factory=list)


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    states = []
    for kind in dict.fromkeys((device_type, "cpu")):
        if torch.amp.is_autocast_available(kind):
            states.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))
    return states


@contextlib.contextmanager
def _autocast(states):
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in states:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        yield


def _rng_state(device: torch.device):
    """The generators a slice may draw from (dropout, router jitter): the CPU's and the device's."""
    module = torch.get_device_module(device.type) if device.type not in ("cpu", "meta") else None
    device_state = module.get_rng_state(device) if module is not None else None
    return torch.get_rng_state(), device_state


@contextlib.contextmanager
def _replaying(state, device: torch.device):
    cpu_state, device_state = state
    devices = [device] if device_state is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.get_device_module(device.type).set_rng_state(device_state, device)
        yield


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, x: torch.Tensor, *parameters: nn.Parameter):
        ctx.run = run
        ctx.parameters = parameters
        ctx.save_for_backward(x)
        outputs, run.outputs = run.outputs, None
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, run.differentiable, strict=True) if not d])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        run: _Run = ctx.run
        (x,) = ctx.saved_tensors
        parameters = ctx.parameters
        wants_x = ctx.needs_input_grad[1]
        grad_x = torch.zeros_like(x) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(parameters)
        layouts = run.layouts + [layout for _key, _index, layout in run.recorded]
        keys = list(dict.fromkeys(key for key, _index, _layout in run.recorded))
        for tile, (start, stop) in enumerate(run.bounds):
            pairs = []
            with _replaying(run.rng_states[tile], x.device), torch.enable_grad(), _autocast(run.autocast):
                leaf = x[:, start:stop].detach().requires_grad_(wants_x)
                with collecting(keys) as records:
                    output = run.forward(leaf.clone())  # a copy: the MLP may change its input in place
                tensors = run.structure.tensors(output)
                tensors += [records[key][index] for key, index, _layout in run.recorded]
                for tensor, grad, layout in zip(tensors, grads, layouts, strict=True):
                    if grad is not None and tensor.requires_grad:
                        pairs.append((tensor, _tile_of(grad, layout, run.batch, start, stop)))
            if not pairs:
                continue
            inputs = ([leaf] if wants_x else []) + list(parameters)
            found = torch.autograd.grad(
                [tensor for tensor, _ in pairs], inputs, [grad for _, grad in pairs], allow_unused=True
            )
            if wants_x and found[0] is not None:
                grad_x[:, start:stop] = found[0]
            for index, grad in enumerate(found[1:] if wants_x else found):
                if grad is None:
                    continue
                if sums[index] is None:
                    sums[index] = grad
                else:
                    sums[index] += grad
        return (None, grad_x, *sums)


def tiled_forward(self: nn.Module, *args, **kwargs):
    """The module's forward, one slice of the sequence at a time when grad is on and the sequence
    is longer than a tile (bound to the module instance)."""
    slot: _Slot = self.__dict__[STATE_ATTR]
    forward = slot.forward_of(self)
    hidden = args[0] if len(args) == 1 and not kwargs else None
    if (
        slot.untileable is not None
        or not isinstance(hidden, torch.Tensor)
        or hidden.dim() != 3
        or hidden.shape[1] <= slot.tile_tokens
        or not torch.is_grad_enabled()
    ):
        return forward(*args, **kwargs)
    try:
        run = _prepare(self, forward, hidden, slot.tile_tokens)
    except _Untileable as reason:
        slot.untileable = str(reason)
        logger.warning(
            "hf_offload: %s runs untiled: %s (sequence tiling needs a module whose outputs are per token)",
            type(self).__name__,
            reason,
        )
        return forward(*args, **kwargs)
    parameters = [p for p in self.parameters() if p.requires_grad]
    if not (hidden.requires_grad or parameters):
        return run.structure.rebuild(run.outputs)  # nothing to differentiate: the slices' outputs are it
    outputs = _TiledMLP.apply(run, hidden, *parameters)
    main = len(run.layouts)
    collector = active_collector()
    for (key, _index, _layout), record in zip(run.recorded, outputs[main:], strict=True):
        collector[key].append(record)
    return run.structure.rebuild(list(outputs[:main]))


def _prepare(module: nn.Module, forward, hidden: torch.Tensor, tile_tokens: int) -> _Run:
    """Run every slice under no_grad and check that their outputs join up; the joined outputs are
    what the Function returns. Raises _Untileable before anything is recorded when they do not."""
    batch, length = hidden.shape[:2]
    bounds = [(start, min(start + tile_tokens, length)) for start in range(0, length, tile_tokens)]
    collector = active_collector()
    keys = [key for key, value in (collector or {}).items() if isinstance(value, list)]
    structure = None
    parts: list[list[torch.Tensor]] = []
    record_parts: dict[str, list[list[torch.Tensor]]] = {}  # key -> per record of a call, its slices
    rng_states = []
    with torch.no_grad():
        for start, stop in bounds:
            rng_states.append(_rng_state(hidden.device))
            before = {key: len(collector[key]) for key in keys}
            output = forward(hidden[:, start:stop].clone())  # a copy: the MLP may change its input in place
            for key in keys:
                # This slice's records come out: one record for all tokens goes back after the Function.
                new = collector[key][before[key] :]
                del collector[key][before[key] :]
                slices = record_parts.setdefault(key, [[] for _ in new]) if start == 0 else record_parts.get(key, [])
                if len(new) != len(slices):
                    raise _Untileable(f"its slices recorded different numbers of {key!r}")
                for pieces, value in zip(slices, new, strict=True):
                    pieces.append(value)
            if structure is None:
                structure = _Structure(output)
            for position, tensor in enumerate(structure.tensors(output)):
                if len(parts) <= position:
                    parts.append([])
                parts[position].append(tensor)
    layouts = [_layout(group[0], batch, bounds[0][1] - bounds[0][0]) for group in parts]
    for group, layout in zip(parts, layouts, strict=True):
        for piece, (start, stop) in zip(group, bounds, strict=True):
            if _layout(piece, batch, stop - start) != layout:
                raise _Untileable("slices returned outputs laid out differently")
    recorded = []
    outputs = [_join(group, layout, batch) for group, layout in zip(parts, layouts, strict=True)]
    for key, records in record_parts.items():
        for index, pieces in enumerate(records):
            layout = _layout(pieces[0], batch, bounds[0][1] - bounds[0][0])
            recorded.append((key, index, layout))
            outputs.append(_join(pieces, layout, batch))
    run = _Run(
        forward=forward,
        batch=batch,
        bounds=bounds,
        structure=structure,
        layouts=layouts,
        recorded=recorded,
        rng_states=rng_states,
        autocast=_autocast_state(hidden.device.type),
        outputs=outputs,
    )
    run.differentiable = [tensor.is_floating_point() or tensor.is_complex() for tensor in outputs]
    return run


def install(module: nn.Module, tile_tokens: int) -> None:
    existing: _Slot | None = module.__dict__.get(STATE_ATTR)
    previous = module.__dict__.get("forward")
    if existing is not None and isinstance(previous, types.MethodType) and previous.__func__ is tiled_forward:
        previous = existing.previous_forward  # ours already: reconfigure, never stack
    setattr(module, STATE_ATTR, _Slot(tile_tokens, previous))
    module.forward = types.MethodType(tiled_forward, module)


def uninstall(module: nn.Module) -> None:
    slot: _Slot | None = module.__dict__.get(STATE_ATTR)
    if slot is not None:
        current = module.__dict__.get("forward")
        if isinstance(current, types.MethodType) and current.__func__ is tiled_forward:
            if slot.previous_forward is None:
                del module.forward
            else:
                module.forward = slot.previous_forward
        delattr(module, STATE_ATTR)
    projections = module.__dict__.get(PROJECTIONS_ATTR)
    if projections is not None:
        projections.handle.remove()
        delattr(module, PROJECTIONS_ATTR)


def is_tiled(module: nn.Module) -> bool:
    current = module.__dict__.get("forward")
    ours = isinstance(current, types.MethodType) and current.__func__ is tiled_forward
    return ours and STATE_ATTR in module.__dict__


@dataclass
class _Projections:
    tile_tokens: int
    handle: object = None


def tile_projections(attention: nn.Module, tile_tokens: int) -> None:
    """Tile the attention module's linear projections, found at each of its calls: PEFT may
    replace them by LoRA layers after tiling was enabled, and the LoRA layer as a whole (its
    float32 casts included) is what should run per slice."""
    from ..adapters import is_linear_like

    def tile_children(module, args) -> None:
        for child in module._modules.values():
            if child is not None and STATE_ATTR not in child.__dict__ and is_linear_like(child):
                install(child, tile_tokens)

    uninstall(attention)
    state = _Projections(tile_tokens)
    state.handle = attention.register_forward_pre_hook(tile_children)
    setattr(attention, PROJECTIONS_ATTR, state)
