"""Learning a module call once and replaying it: what makes a tiled step cheap to simulate.

Sequence tiling calls each module it tiles (an MLP, a norm, a projection, lm_head) once per slice
of the sequence: in forward under no_grad, and in backward with grad, recomputing the slice and
differentiating it with `torch.autograd.grad`. At a million tokens that is 256 calls per module
and step on the same shapes, each costing the full Python price of the module (PEFT's LoRA
forward is about 0.6 ms) and of autograd. `SliceMemo` sits under tiling, as an instance-level
forward of every submodule of the decoder layers and of lm_head, installed before tiling wraps
them, so that tiling's slices call it.

A call is memoised when it is a pure function of what the key holds: grad off (a forward slice),
or grad on inside an autograd node with no saved-tensor hooks (a slice recomputed in backward).
The key is what the call actually is: the module instance, the arguments' shapes, strides,
dtypes and whether they require grad, grad mode, the autocast state, and the phase and module
the step's attribution is in. Any other call runs as it is.

- The first call with a key runs the module for real in a sandbox account of the tracker, on
  fresh tensors like its arguments, and learns its effect: its own peak over what was live at
  the call and what held it, its outputs, what autograd saved for backward, its FLOPs and
  traffic; with grad, also its backward's (run with `torch.autograd.grad` as tiling does): its
  own peak, and the gradients it returns. The call is then replayed.
- The second call with the key is learnt again and must agree with the first; if it does not,
  or the call did anything a replay cannot repeat (changed an input in place, left something
  allocated besides its outputs and saved tensors, recorded an output of transformers' output
  capturing, as MoE routers do, depended on a tensor requiring grad that is neither an argument
  nor one of the module's parameters), that key runs for real from then on. The fast path is
  exact, or steps aside.
- Later calls replay: the tracker gets the call's peak over its live bytes (`transient`), the
  outputs and saved bytes are allocated as fresh meta tensors under the tags they had, and the
  counts are added. With grad, a `torch.autograd.Function` stands for the call: its backward
  replays the backward the same way and returns gradients of the learnt shapes.

Memory is exact: every replayed figure is measured relative to the bytes live at the call, and a
replayed call leaves the same bytes live, under the same tags, as a real one. One assumption is
tiling's, and holds there: a slice's backward runs as one `autograd.grad` on the slice's own
graph, so its nodes run together.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .tracker import Account, MemoryTracker, Peak

STATE_ATTR = "_hf_offload_simulator_memo"
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


class _NotReplayable(Exception):
    """The call cannot be replayed: it runs for real."""


@dataclass(frozen=True)
class _Output:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    tag: tuple
    requires_grad: bool


@dataclass
class _Effect:
    """One call's (or one backward's) effect, relative to the bytes live when it starts."""

    peak: int  # its own peak over those bytes
    op: str
    tag: tuple
    node: str
    by_tag: dict[tuple, int]  # what it adds at its peak, by tag
    counts: Account  # its FLOPs and traffic

    def same_as(self, other: _Effect) -> bool:
        return self.peak == other.peak and self.by_tag == other.by_tag and _counts(self.counts) == _counts(other.counts)


def _counts(account: Account) -> tuple:
    compute = {key: value for key, value in account.compute.items() if value}
    by_tag = {tag: tuple(counts) for tag, counts in account.flops_by_tag.items() if any(counts)}
    return account.matmul_flops, account.attention_flops, account.traffic_bytes, compute, by_tag


@dataclass
class _Learnt:
    forward: _Effect
    structure: tuple  # per output item: ("tensor", index into outputs) or ("value", constant)
    single: bool  # the call returned one tensor, not a tuple
    outputs: list[_Output]
    saved: dict[tuple, int]  # bytes autograd saved for backward, beyond outputs and arguments, by tag
    inputs_saved: list[bool]  # per tensor argument: whether autograd saved it
    inputs_grad: list[bool]  # per tensor argument: whether it requires grad
    parameters: list[nn.Parameter]  # the module's parameters that require grad
    backward: _Effect | None = None
    gradients: list[_Output | None] = field(default_factory=list)  # per input, then per parameter

    def same_as(self, other: _Learnt) -> bool:
        if not (
            self.forward.same_as(other.forward)
            and self.structure == other.structure
            and self.outputs == other.outputs
            and self.saved == other.saved
            and self.inputs_saved == other.inputs_saved
            and self.gradients == other.gradients
        ):
            return False
        if (self.backward is None) != (other.backward is None):
            return False
        return self.backward is None or self.backward.same_as(other.backward)


@dataclass
class _Key:
    entry: _Learnt | None = None
    seen: int = 0
    never: bool = False  # runs for real


class SliceMemo:
    """Installed on a model for one step: learns and replays module calls (module docstring)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.keys: dict[tuple, _Key] = {}
        self.learning = False
        self.replays = 0
        self.real_calls = 0
        self.modules: list[nn.Module] = []

    # -- installing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self, modules) -> Iterator[SliceMemo]:
        for module in modules:
            if STATE_ATTR in module.__dict__ or type(module).forward is nn.Module.forward:
                continue
            setattr(module, STATE_ATTR, (self, module.__dict__.get("forward")))
            module.forward = types.MethodType(_memo_forward, module)
            self.modules.append(module)
        try:
            yield self
        finally:
            for module in self.modules:
                _memo, previous = module.__dict__.pop(STATE_ATTR)
                if previous is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = previous
            self.modules.clear()
            self.keys.clear()

    # -- a call -----------------------------------------------------------------------------------

    def call(self, module: nn.Module, forward, args: tuple, kwargs: dict):
        if self.learning:
            return forward(*args, **kwargs)
        grad = torch.is_grad_enabled()
        if grad and (
            torch._C._current_autograd_node() is None
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        ):
            return forward(*args, **kwargs)
        try:
            key = (id(module), grad, _describe(args), _describe(kwargs), _autocast_state(), self.tracker.tag)
        except _NotReplayable:
            return forward(*args, **kwargs)
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = _Key()
        if state.never:
            self.real_calls += 1
            return forward(*args, **kwargs)
        state.seen += 1
        if state.seen <= 2:
            try:
                learnt = self._learn(module, forward, args, kwargs, grad)
            except _NotReplayable:
                state.never = True
                self.real_calls += 1
                return forward(*args, **kwargs)
            if state.entry is not None and not state.entry.same_as(learnt):
                state.never = True
                self.real_calls += 1
                return forward(*args, **kwargs)
            state.entry = learnt
        self.replays += 1
        learnt = state.entry
        tensors = [value for value in _flatten((args, kwargs)) if isinstance(value, torch.Tensor)]
        if not grad:
            outputs = self._replay_forward(learnt)
            return _rebuild(learnt, outputs)
        outputs = _Replay.apply(self, learnt, len(tensors), *tensors, *learnt.parameters)
        return _rebuild(learnt, list(outputs))

    # -- learning -----------------------------------------------------------------------------------

    def _learn(self, module, forward, args, kwargs, grad: bool) -> _Learnt:
        tracker = self.tracker
        outer = tracker.account
        outer_live = outer.live
        collector = _collector_lengths()
        self.learning = True
        try:
            with tracker.sandbox() as account:
                learnt = self._learn_in(account, module, forward, args, kwargs, grad)
                if account.live:
                    raise _NotReplayable  # something it made outlives the call
        finally:
            self.learning = False
        if outer.live != outer_live or _collector_lengths() != collector:
            raise _NotReplayable  # it freed or allocated outside its own account, or recorded an output
        return learnt

    def _learn_in(self, account: Account, module, forward, args, kwargs, grad: bool) -> _Learnt:
        tracker = self.tracker
        flat, rebuild = _flatten_with(args, kwargs)
        originals = [value for value in flat if isinstance(value, torch.Tensor)]
        copies = [_like(tensor, tracker) for tensor in originals]
        versions = [copy._version for copy in copies]
        copy_keys = [id(copy.untyped_storage()) for copy in copies]
        copy_args, copy_kwargs = rebuild(iter(copies))
        parameters = [p for p in module.parameters() if p.requires_grad] if grad else []
        start_sequence = _next_sequence_nr(tracker) if grad else 0
        base, base_tags = account.live, dict(account.live_by_tag)
        account.peak = Peak(bytes=base)
        account.pending_snapshot = False
        account.clear_counts()
        packed: set[int] = set()
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.add(id(t.untyped_storage())), t)[1], lambda t: t)
            if grad
            else contextlib.nullcontext()
        )
        with hooks:
            result = forward(*copy_args, **copy_kwargs)
        if any(copy._version != version for copy, version in zip(copies, versions, strict=True)):
            raise _NotReplayable  # it changed an argument in place
        forward_effect = _effect(account, base, base_tags)
        structure, single, outputs = _structure(result)
        described, output_keys = [], set()
        for tensor in outputs:
            key = id(tensor.untyped_storage())
            block = account.blocks.get(key)
            if block is None or key in output_keys or tensor.storage_offset() or block[0] != _extent(tensor):
                raise _NotReplayable  # not a fresh tensor of its own
            output_keys.add(key)
            described.append(
                _Output(tuple(tensor.shape), tensor.stride(), tensor.dtype, block[1], tensor.requires_grad)
            )
        saved = dict(account.live_by_tag)
        for tag, nbytes in base_tags.items():
            saved[tag] = saved.get(tag, 0) - nbytes
        for output in described:
            saved[output.tag] -= _extent_of(output)
        saved = {tag: nbytes for tag, nbytes in saved.items() if nbytes}
        if not grad:
            if saved:
                raise _NotReplayable
            return _Learnt(forward_effect, structure, single, described, {}, [False] * len(copies),
                           [False] * len(copies), [])  # fmt: skip
        if any(nbytes < 0 for nbytes in saved.values()):
            raise _NotReplayable
        _check_graph(outputs, copies, parameters, start_sequence)
        inputs_saved = [key in packed for key in copy_keys]
        inputs_grad = [copy.requires_grad for copy in copies]
        learnt = _Learnt(forward_effect, structure, single, described, saved, inputs_saved, inputs_grad, parameters)
        # Backward, as tiling runs it: one autograd.grad over the slice's graph, every output given a
        # gradient (its view of the whole gradient: no memory of its own).
        differentiable = [tensor for tensor in outputs if tensor.requires_grad]
        targets = [torch.autograd.graph.get_gradient_edge(copy) for copy in copies if copy.requires_grad]
        targets += parameters
        if differentiable and targets:
            with tracker.host_allocations():
                gradients_in = [
                    torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in differentiable
                ]
            # Arguments that are not views of something else are held by the graph alone, as a
            # slice tiling cuts and copies is: let go of them as the caller does.
            held = [copy for copy, original in zip(copies, originals, strict=True) if original._base is not None]
            del copies, copy_args, copy_kwargs, result, originals
            start, start_tags = account.live, dict(account.live_by_tag)
            account.peak = Peak(bytes=start)
            account.pending_snapshot = False
            account.clear_counts()
            found = torch.autograd.grad(differentiable, targets, gradients_in, allow_unused=True)
            learnt.backward = _effect(account, start, start_tags)
            del differentiable, outputs, gradients_in, held
            gradients = []
            for gradient in found:
                if gradient is None:
                    gradients.append(None)
                    continue
                block = account.blocks.get(id(gradient.untyped_storage()))
                if block is None or gradient.storage_offset() or block[0] != _extent(gradient):
                    raise _NotReplayable
                gradients.append(_Output(tuple(gradient.shape), gradient.stride(), gradient.dtype, block[1], False))
            del found
            wanted = iter(gradients)
            learnt.gradients = [next(wanted) if wants else None for wants in inputs_grad] + list(wanted)
        else:
            learnt.gradients = [None] * (len(inputs_grad) + len(parameters))
            learnt.backward = _Effect(0, "", (), "", {}, Account())
        return learnt

    # -- replaying ----------------------------------------------------------------------------------

    def _replay_forward(self, learnt: _Learnt) -> list[torch.Tensor]:
        tracker = self.tracker
        effect = learnt.forward
        tracker.transient(effect.peak, op=effect.op, tag=effect.tag, node=effect.node, by_tag=effect.by_tag)
        tracker.count(effect.counts)
        return [_allocate(tracker, output) for output in learnt.outputs]

    def _replay_saved(self, learnt: _Learnt) -> list[torch.Tensor]:
        return [_allocate_bytes(self.tracker, nbytes, tag) for tag, nbytes in learnt.saved.items()]

    def _replay_backward(self, learnt: _Learnt) -> list[torch.Tensor | None]:
        tracker = self.tracker
        effect = learnt.backward
        tracker.transient(effect.peak, op=effect.op, tag=effect.tag, node=effect.node, by_tag=effect.by_tag)
        tracker.count(effect.counts)
        return [None if gradient is None else _allocate(tracker, gradient) for gradient in learnt.gradients]


def _memo_forward(self: nn.Module, *args, **kwargs):
    memo, previous = self.__dict__[STATE_ATTR]
    forward = previous if previous is not None else types.MethodType(type(self).forward, self)
    return memo.call(self, forward, args, kwargs)


class _Replay(torch.autograd.Function):
    """A learnt call with grad: forward allocates its outputs and saved bytes, backward replays
    its backward and returns gradients for the tensor arguments and the module's parameters."""

    @staticmethod
    def forward(ctx, memo: SliceMemo, learnt: _Learnt, count: int, *inputs):
        ctx.set_materialize_grads(False)
        ctx.memo, ctx.learnt = memo, learnt
        outputs = memo._replay_forward(learnt)
        ctx.saved = memo._replay_saved(learnt)
        # The arguments autograd saved stay alive with the graph, as in the real call.
        ctx.held = [tensor for tensor, saved in zip(inputs[:count], learnt.inputs_saved, strict=True) if saved]
        ctx.mark_non_differentiable(*[t for t, o in zip(outputs, learnt.outputs, strict=True) if not o.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *_gradients):
        gradients = ctx.memo._replay_backward(ctx.learnt)
        ctx.saved = ctx.held = None
        return (None, None, None, *gradients)


# -- helpers ----------------------------------------------------------------------------------------


def _describe(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NotReplayable
        return (value.shape, value.stride(), value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple([_describe(item) for item in value])
    if isinstance(value, dict):
        return tuple([(name, _describe(item)) for name, item in sorted(value.items())])
    if value is None or isinstance(value, _PLAIN):
        return (type(value), value)
    raise _NotReplayable


def _autocast_state() -> tuple:
    return tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda"))


def _flatten(value) -> Iterator:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for name in sorted(value):
            yield from _flatten(value[name])
    else:
        yield value


def _flatten_with(args: tuple, kwargs: dict):
    """The leaves of (args, kwargs), and a function putting new leaves back in their places."""
    flat = list(_flatten((args, kwargs)))

    def build(value, leaves):
        if isinstance(value, (list, tuple)):
            return type(value)(build(item, leaves) for item in value)
        if isinstance(value, dict):
            return {name: build(value[name], leaves) for name in sorted(value)}
        return next(leaves) if isinstance(value, torch.Tensor) else value

    def rebuild(tensors: Iterator):
        return build(args, tensors), build(kwargs, tensors)

    return flat, rebuild


def _like(tensor: torch.Tensor, tracker: MemoryTracker) -> torch.Tensor:
    """A fresh tensor of the argument's metadata; requiring grad as it does, through a graph of
    its own (not a leaf, so that autograd can let go of it as of the slice it stands for)."""
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if tensor.requires_grad:
        with tracker.host_allocations():
            root = torch.empty((), dtype=tensor.dtype, device="meta", requires_grad=True)
        copy.copy_(root.expand(tensor.shape))
    return copy


def _extent(tensor: torch.Tensor) -> int:
    return _extent_of(_Output(tuple(tensor.shape), tensor.stride(), tensor.dtype, (), False))


def _extent_of(output: _Output) -> int:
    if any(size == 0 for size in output.size):
        return 0
    elements = 1 + sum((size - 1) * stride for size, stride in zip(output.size, output.stride, strict=True))
    return elements * output.dtype.itemsize


def _effect(account: Account, base: int, base_tags: dict[tuple, int]) -> _Effect:
    account.settle()
    peak = account.peak
    by_tag = dict(peak.live_by_tag) if peak.bytes > base else {}
    for tag, nbytes in base_tags.items():
        if by_tag:
            by_tag[tag] = by_tag.get(tag, 0) - nbytes
    by_tag = {tag: nbytes for tag, nbytes in by_tag.items() if nbytes}
    counts = Account()
    counts.matmul_flops, counts.attention_flops = account.matmul_flops, account.attention_flops
    counts.traffic_bytes = account.traffic_bytes
    counts.compute.update(account.compute)
    for tag, values in account.flops_by_tag.items():
        counts.flops_by_tag[tag] = list(values)
    return _Effect(max(peak.bytes - base, 0), peak.op, peak.tag, peak.node, by_tag, counts)


def _structure(result) -> tuple[tuple, bool, list[torch.Tensor]]:
    if isinstance(result, torch.Tensor):
        return (("tensor", 0),), True, [result]
    if type(result) not in (tuple, list):
        raise _NotReplayable
    structure, tensors = [], []
    for item in result:
        if isinstance(item, torch.Tensor):
            structure.append(("tensor", len(tensors)))
            tensors.append(item)
        elif item is None or isinstance(item, _PLAIN):
            structure.append(("value", item))
        else:
            raise _NotReplayable
    return tuple(structure), False, tensors


def _rebuild(learnt: _Learnt, tensors: list[torch.Tensor]):
    if learnt.single:
        return tensors[0]
    return tuple(tensors[index] if kind == "tensor" else index for kind, index in learnt.structure)


def _allocate(tracker: MemoryTracker, output: _Output) -> torch.Tensor:
    return tracker.allocate(output.size, output.stride, output.dtype, output.tag)


def _allocate_bytes(tracker: MemoryTracker, nbytes: int, tag: tuple) -> torch.Tensor:
    return tracker.allocate((nbytes,), (1,), torch.uint8, tag)


def _next_sequence_nr(tracker: MemoryTracker) -> int:
    with torch.enable_grad(), tracker.host_allocations():
        probe = torch.empty((), device="meta", requires_grad=True) * 1
    return probe.grad_fn._sequence_nr() + 1


def _check_graph(outputs, copies, parameters, start: int) -> None:
    """Every tensor requiring grad the outputs depend on is an argument or one of the module's
    parameters: the replay's gradients go to those only."""
    inputs = {id(copy.grad_fn) for copy in copies if copy.grad_fn is not None}
    allowed = {id(p) for p in parameters}
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in inputs:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            if id(variable) not in allowed:
                raise _NotReplayable
            continue
        if node._sequence_nr() < start:
            raise _NotReplayable  # made before the call: a tensor from outside requiring grad
        stack.extend(next_node for next_node, _index in node.next_functions)


def _collector_lengths():
    try:
        from hf_offload.integrations.transformers_outputs import active_collector
    except ImportError:
        return None
    collector = active_collector()
    if not collector:
        return None
    return {key: len(value) for key, value in collector.items() if isinstance(value, list)}
