"""A per-token module (a decoder layer's MLP, its norms, its attention's projections, the final
norm), run one slice of the sequence at a time.

The module is per token, so its output for a slice of tokens depends on those tokens only. In
forward the slices run under no_grad and only the module's input is saved; in backward each
slice is recomputed with grad and differentiated with `torch.autograd.grad`, and the parameters'
gradients are summed over the slices and returned once. The intermediate activations of one
slice exist at a time. (Returned once, not accumulated per slice into `.grad`: each parameter's
AccumulateGrad runs once per step, as without tiling, so DDP's reducer and FSDP2's post-backward
see one gradient, and hooks on gradients fire as they would.) In forward the slices run inside
one call of the module, whose hooks see its real output; in backward the module is not called
again (its hooks run once per step, as without tiling), and only the forwards that wrap tiling's
run around the slices (`_inside_outer_forwards`).

It wraps the module's own current forward on the instance, so whatever the module is runs
unchanged: transformers' gated MLP, one with LoRA or DoRA adapters, Liger's SwiGLU forward, an
MoE block, a LoRA'd projection with its float32 adapters (whose float32 copies of their input
then exist for one slice). MoE routers record their logits through transformers' output
capturing, once per call: the slices' records are taken out and one record for all tokens,
reassembled in token order and differentiable, is put back, so `outputs.router_logits` and the
load-balancing loss are as without tiling.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import instance_forward
from ..integrations.transformers_outputs import active_collector, collecting
from .gradients import Targets, backward_by_slices, refuse_double_backward
from .replay import Replay, eval_mode_with_grad, say_eval_mode_runs_whole, splits

logger = logging.getLogger("hf_offload")

STATE_ATTR = "_hf_offload_tiled"
PROJECTIONS_ATTR = "_hf_offload_tiled_projections"

UNDER_COMPILE = "sequence tiling runs a module one slice at a time, eagerly: torch.compile breaks the graph there"
_SEQ, _TOKENS = "seq", "tokens"  # output layouts: (batch, tokens, ...) or (batch x tokens, ...)


class _Untileable(Exception):
    """The MLP's outputs cannot be put together from slices: it runs untiled."""


@dataclass
class _Slot:
    """What tiling keeps on a module it tiles."""

    tile_tokens: int
    previous_forward: object  # an instance-level forward that was there before (None: the class's)
    untileable: str | None = None  # why it runs untiled, once found
    signatures: dict = field(default_factory=dict)  # what it returns, by the kind of input
    active: bool = True  # False: disabled while another wrapper still holds ours (a pass-through)
    driving: object = None  # in backward, while the forwards wrapping ours run: what ours runs instead
    said: set = field(default_factory=set)  # the model's notices said, shared by its tiled modules

    def forward_of(self, module: nn.Module):
        if self.previous_forward is not None:
            return self.previous_forward
        return types.MethodType(type(module).forward, module)

    def __getstate__(self) -> dict:
        # A pickled or deep-copied model learns again what its modules return.
        return {**self.__dict__, "signatures": {}, "driving": None}


def _layout(tensor: torch.Tensor, batch: int, tokens: int) -> str:
    if tensor.dim() >= 2 and tensor.shape[0] == batch and tensor.shape[1] == tokens:
        return _SEQ
    if tensor.dim() >= 1 and tensor.shape[0] == batch * tokens:
        return _TOKENS
    shape = tuple(tensor.shape)
    raise _Untileable(f"an output of shape {shape} is neither (batch, tokens, ...) nor (batch x tokens, ...)")


def _tile_of(tensor: torch.Tensor, layout: str, batch: int, start: int, stop: int) -> torch.Tensor:
    if layout == _SEQ:
        return tensor[:, start:stop]
    rows = tensor.view(batch, -1, *tensor.shape[1:])[:, start:stop]
    return rows.reshape(-1, *tensor.shape[1:])


def _write(whole: torch.Tensor, piece: torch.Tensor, layout: str, batch: int, start: int, stop: int) -> None:
    """Copy a slice's output into its place in the whole sequence's."""
    if layout == _SEQ:
        whole[:, start:stop].copy_(piece)
    else:
        rest = whole.shape[1:]
        whole.view(batch, -1, *rest)[:, start:stop].copy_(piece.view(batch, -1, *rest))


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
class _Signature:
    """What a tiled call returns for inputs of one kind, learnt at the first such call: the
    structure, and for each tensor (the module's outputs, then the records it made) its layout,
    its shape after the token dimensions and its dtype."""

    structure: _Structure
    layouts: list[str]
    per_token: list[tuple[tuple[int, ...], torch.dtype]]
    recorded: list[tuple[str, int]]  # (collector key, entry index) of the records, in order
    changes_its_input: bool  # then every slice gets a copy; else a view (copied only to be contiguous)

    def slice_of(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        piece = hidden[:, start:stop]
        return piece.clone() if self.changes_its_input else piece.contiguous()

    def allocate(self, batch: int, length: int, device: torch.device) -> list[torch.Tensor]:
        tensors = []
        for layout, (rest, dtype) in zip(self.layouts, self.per_token, strict=True):
            shape = (batch, length, *rest) if layout == _SEQ else (batch * length, *rest)
            tensors.append(torch.empty(shape, dtype=dtype, device=device))
        return tensors


@dataclass
class _Run:
    """One tiled call: everything the Function's backward needs to recompute a slice exactly."""

    module: nn.Module  # called again for each slice in backward, its hooks with it
    forward: object  # the module's own forward, for the slices in forward (inside its call already)
    constants: tuple[tuple, dict]  # what it was called with besides the hidden states
    batch: int
    bounds: list[tuple[int, int]]
    signature: _Signature | None
    replay: Replay
    targets: Targets | None = None
    outputs: list[torch.Tensor] | None = None  # what the Function returns: filled before or after it

    def forward_slice(self, piece: torch.Tensor):
        rest, kwargs = self.constants
        return self.forward(piece, *rest, **kwargs)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, x: torch.Tensor, *target_tensors: torch.Tensor):
        ctx.run = run
        ctx.save_for_backward(x)
        outputs, run.outputs = run.outputs, None
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        run: _Run = ctx.run
        refuse_double_backward(f"{type(run.module).__name__} (a tiled per-token module)")
        signature = run.signature
        (x,) = ctx.saved_tensors
        keys = list(dict.fromkeys(key for key, _index in signature.recorded))
        rest, kwargs = run.constants

        def recompute(index: int, leaf: torch.Tensor):
            start, stop = run.bounds[index]
            with collecting(keys) as records:
                output = run.forward_slice(signature.slice_of(leaf, 0, stop - start))
            tensors = signature.structure.tensors(output)
            tensors += [records[key][position] for key, position in signature.recorded]
            return [
                (tensor, _tile_of(grad, layout, run.batch, start, stop))
                for tensor, grad, layout in zip(tensors, grads, signature.layouts, strict=True)
                if grad is not None
            ]

        # Not a call of the module: its hooks saw its real output once, in forward, as without tiling
        # (ZeRO-3 and FSDP gather its weights for backward through the hooks they put on that output).
        # A slice's recompute is the module's forward alone: what a hook did to the output is
        # differentiated once, where it happened. The forwards wrapping tiling's (accelerate's device
        # hooks, which load offloaded weights and have no backward hooks) run once around the slices.
        grad_x, sums = _inside_outer_forwards(
            run.module,
            lambda: backward_by_slices(
                x, run.bounds, ctx.needs_input_grad[1], run.targets, run.replay.replaying, recompute
            ),
            (x, *rest),
            kwargs,
        )
        return (None, grad_x, *sums)


def _inside_outer_forwards(module: nn.Module, work, args: tuple, kwargs: dict):
    """`work()`, inside the forwards that wrap tiling's on `module` (put on after tiling was enabled),
    run on the forward's arguments: tiling's forward, reached through them, runs `work` instead of
    the module's (`_Slot.driving`) and gives them None as the output. Directly where nothing wraps
    tiling's forward, where something dropped it since the forward (kernelize at a mode change), or
    where tiling was disabled since."""
    slot: _Slot | None = module.__dict__.get(STATE_ATTR)
    if slot is None or instance_forward.wraps(module, tiled_forward) or instance_forward.dropped(module):
        return work()
    done: list = []
    slot.driving = lambda: done.append(work())
    try:
        module.forward(*args, **kwargs)
    finally:
        slot.driving = None
    if not done:  # the chain no longer reaches tiling's forward (replaced since): the slices on their own
        done.append(work())
    return done.pop()


def _sliceable_along_dim_1(module: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether dim 1 of the input is one the module computes each index of on its own. An MLP: its
    (batch, tokens, hidden) input alone. A norm over its last dimension(s), whatever comes before
    them: Qwen3's q_norm on (batch, tokens, heads, head_dim) too, but not Chameleon's, whose
    weight spans (heads, head_dim) of a (batch x tokens, heads, head_dim) input."""
    from ..adapters.base import is_norm

    if not is_norm(module):
        return hidden.dim() == 3
    shape = getattr(module, "normalized_shape", None)
    weight = module._parameters.get("weight")
    spans = len(shape) if isinstance(shape, (tuple, list)) else weight.dim() if weight is not None else 1
    return hidden.dim() >= 3 and hidden.dim() - spans >= 2


@torch.compiler.disable(reason=UNDER_COMPILE)
def tiled_forward(self: nn.Module, *args, **kwargs):
    """The module's forward, one slice of the sequence at a time when it is training (`splits`:
    grad on or off, so that a reentrant checkpoint's two passes slice alike) and the sequence is
    longer than a tile (bound to the module instance). In eval mode it runs whole.

    Once the module has been called with inputs of this kind, the Function saves its input before
    any slice runs and the slices fill its outputs afterwards: inside a non-reentrant checkpoint's
    recompute, that input is the last tensor the layer saves, so PyTorch stops the recompute
    there and the slices are computed once in forward and once in backward, as without tiling."""
    slot: _Slot = self.__dict__[STATE_ATTR]
    if slot.driving is not None:  # reached in backward through the forwards wrapping ours: the slices' backward
        return slot.driving()
    own_forward = slot.forward_of(self)
    if not slot.active:
        return own_forward(*args, **kwargs)
    hidden = args[0] if args else None
    if (
        slot.untileable is not None
        or not isinstance(hidden, torch.Tensor)
        or not _sliceable_along_dim_1(self, hidden)
        or hidden.shape[1] <= slot.tile_tokens
    ):
        return own_forward(*args, **kwargs)
    if not splits(self):
        if eval_mode_with_grad(self):
            say_eval_mode_runs_whole(self, slot.said)
        return own_forward(*args, **kwargs)
    rest = args[1:]
    if any(isinstance(value, torch.Tensor) for value in (*rest, *kwargs.values())):
        # Bloom's and MPT's MLPs take the residual, DeepSeek-V4's the input ids: tensors the slices
        # would need their parts of, and gradients for.
        slot.untileable = "it takes tensors besides the hidden states"
        logger.warning("hf_offload: %s runs untiled: %s", type(self).__name__, slot.untileable)
        return own_forward(*args, **kwargs)
    batch, length = hidden.shape[:2]
    bounds = [(start, min(start + slot.tile_tokens, length)) for start in range(0, length, slot.tile_tokens)]
    collector = active_collector()
    keys = tuple(key for key, value in (collector or {}).items() if isinstance(value, list))
    replay = Replay(hidden.device)
    constants = (tuple(map(repr, rest)), tuple((key, repr(value)) for key, value in sorted(kwargs.items())))
    kind = (batch, tuple(hidden.shape[2:]), hidden.dtype, hidden.device, keys, replay.autocast, constants)
    signature = slot.signatures.get(kind)
    run = _Run(self, own_forward, (rest, kwargs), batch, bounds, signature, replay)
    if signature is None:
        try:
            run.signature, run.outputs = _learn(run, hidden, collector, keys)
        except _Untileable as reason:
            slot.untileable = str(reason)
            logger.warning(
                "hf_offload: %s runs untiled: %s (sequence tiling needs a module whose outputs are per token)",
                type(self).__name__,
                reason,
            )
            return own_forward(*args, **kwargs)
        slot.signatures[kind] = run.signature
    run.targets = Targets.of(self)
    differentiable = hidden.requires_grad or run.targets.tensors or run.targets.zero3
    if run.outputs is None:
        run.outputs = run.signature.allocate(batch, length, hidden.device)
        filling = list(run.outputs)
        if differentiable:
            outputs = _TiledMLP.apply(run, hidden, *run.targets.tensors)  # saves the input first
        else:
            outputs, run.outputs = run.outputs, None
        try:
            _fill(run, hidden, filling, collector, keys, start=0)
        except _Untileable as reason:
            raise RuntimeError(
                f"hf_offload: {type(self).__name__} under sequence tiling returned outputs unlike those of its "
                f"earlier calls with inputs of the same shape ({reason}): its outputs are not per token"
            ) from None
    elif differentiable:
        outputs = _TiledMLP.apply(run, hidden, *run.targets.tensors)
    else:
        outputs, run.outputs = run.outputs, None
    main = len(run.signature.structure.tensor_positions)
    for (key, _index), record in zip(run.signature.recorded, outputs[main:], strict=True):
        collector[key].append(record)
    return run.signature.structure.rebuild(list(outputs[:main]))


def _slice(run: _Run, index: int, piece: torch.Tensor, collector, keys) -> tuple[object, list]:
    """Slice `index` under no_grad: the module's output, and the records it made (taken out of
    the collector: one record for all tokens goes back after the Function)."""
    before = {key: len(collector[key]) for key in keys}
    output = run.forward_slice(piece)
    run.replay.slice_done(last=index == len(run.bounds) - 1)
    records = []
    for key in keys:
        new = collector[key][before[key] :]
        del collector[key][before[key] :]
        records.extend((key, position, value) for position, value in enumerate(new))
    return output, records


def _learn(run: _Run, hidden: torch.Tensor, collector, keys) -> tuple[_Signature, list[torch.Tensor]]:
    """The first call with inputs of this kind: the first slice shows what the module returns,
    and every slice is checked to join up before the Function (raises _Untileable otherwise)."""
    batch = run.batch
    start, stop = run.bounds[0]
    probe = hidden[:, start:stop].clone()  # a copy: whether the module changes its input in place shows on it
    version = probe._version
    with torch.no_grad():
        output, records = _slice(run, 0, probe, collector, keys)
    structure = _Structure(output)
    tensors = structure.tensors(output) + [value for _key, _index, value in records]
    layouts = [_layout(tensor, batch, stop - start) for tensor in tensors]
    per_token = [
        (tuple(t.shape[2:] if layout == _SEQ else t.shape[1:]), t.dtype)
        for t, layout in zip(tensors, layouts, strict=True)
    ]
    recorded = [(key, index) for key, index, _value in records]
    signature = _Signature(structure, layouts, per_token, recorded, changes_its_input=probe._version != version)
    outputs = signature.allocate(batch, hidden.shape[1], hidden.device)
    with torch.no_grad():
        for whole, piece, layout in zip(outputs, tensors, layouts, strict=True):
            _write(whole, piece, layout, batch, start, stop)
    run.signature = signature
    _fill(run, hidden, outputs, collector, keys, start=1)
    return signature, outputs


def _fill(run: _Run, hidden, outputs, collector, keys, *, start: int) -> None:
    """Run the slices from `start` on under no_grad, writing their outputs and records into place
    (raises _Untileable where a slice's outputs do not fit)."""
    signature = run.signature
    with torch.no_grad():
        for index, (first, stop) in enumerate(run.bounds[start:], start):
            output, records = _slice(run, index, signature.slice_of(hidden, first, stop), collector, keys)
            if [(key, position) for key, position, _value in records] != signature.recorded:
                raise _Untileable(f"its slices recorded different outputs ({[key for key, _i, _v in records]})")
            tensors = signature.structure.tensors(output) + [value for _key, _index, value in records]
            for whole, piece, layout, (rest, dtype) in zip(
                outputs, tensors, signature.layouts, signature.per_token, strict=True
            ):
                expected = (run.batch, stop - first, *rest) if layout == _SEQ else (run.batch * (stop - first), *rest)
                if tuple(piece.shape) != expected or piece.dtype != dtype:
                    raise _Untileable(
                        f"a slice returned {tuple(piece.shape)} {piece.dtype} where {expected} {dtype} was expected"
                    )
                _write(whole, piece, layout, run.batch, first, stop)


def install(module: nn.Module, tile_tokens: int, said: set | None = None) -> None:
    """Tile `module`; `said`: the notices said for its model, shared by the model's tiled modules."""
    notices = set() if said is None else said

    def make_slot(previous) -> _Slot:
        return _Slot(tile_tokens, previous, said=notices)

    instance_forward.install(module, tiled_forward, STATE_ATTR, make_slot)


def reinstate(module: nn.Module) -> bool:
    """Tiling's wrapper back on a module whose forward kernels' `kernelize` replaced since (a hub
    kernel's, or the class's again: `integrations.kernels`); the slices then run what it chose."""
    return instance_forward.reinstate(module, tiled_forward, STATE_ATTR)


def uninstall(module: nn.Module) -> None:
    instance_forward.remove(module, tiled_forward, STATE_ATTR)
    projections = module.__dict__.get(PROJECTIONS_ATTR)
    if projections is not None:
        projections.handle.remove()
        delattr(module, PROJECTIONS_ATTR)


def is_tiled(module: nn.Module) -> bool:
    slot: _Slot | None = module.__dict__.get(STATE_ATTR)
    return slot is not None and slot.active


@dataclass
class _Projections:
    tile_tokens: int
    handle: object = None


def _tile_children(tile_tokens: int, said: set, attention: nn.Module, args) -> None:
    """The attention's forward pre-hook: tile its linear projections as they are now. (A function
    of the module, not a closure, so that a model with tiling pickles.)"""
    from ..adapters import is_linear_like

    for child in attention._modules.values():
        if child is not None and not is_tiled(child) and is_linear_like(child):
            install(child, tile_tokens, said)


def tile_projections(attention: nn.Module, tile_tokens: int, said: set) -> None:
    """Tile the attention module's linear projections, found at each of its calls: PEFT may
    replace them by LoRA layers after tiling was enabled, and the LoRA layer as a whole (its
    float32 casts included) is what should run per slice."""
    uninstall(attention)
    state = _Projections(tile_tokens)
    state.handle = attention.register_forward_pre_hook(functools.partial(_tile_children, tile_tokens, said))
    setattr(attention, PROJECTIONS_ATTR, state)
