"""Learning a module call once and replaying it: what makes a tiled step cheap to simulate.

Sequence tiling calls each module it tiles (an MLP, a norm, a projection, lm_head) once per slice
of the sequence: in forward under no_grad, and in backward with grad, recomputing the slice and
differentiating it with `torch.autograd.grad`. At a million tokens that is 256 calls per module
and step on the same shapes, each costing the full Python price of the module (PEFT's LoRA
forward is about 0.6 ms) and of autograd. `SliceMemo` sits under tiling, as an instance-level
forward of every submodule of the decoder layers, of the final norm and of lm_head, installed
before tiling wraps them, so that tiling's slices call it.

A call is memoised when it is a pure function of what the key holds: grad off (a forward slice),
or grad on inside an autograd node with no saved-tensor hooks (a slice recomputed in backward).
The key is what the call actually is: the module instance, the arguments' shapes, strides,
dtypes, whether they require grad and whether each is a view, grad mode, the autocast state, and
the phase and module the step's attribution is in. Any other call runs as it is.

- The first call with a key runs the module for real in a sandbox account of the tracker, on
  fresh tensors like its arguments, and learns its effect: its own peak over what was live at
  the call and what held it, its outputs, what autograd saved for backward, its FLOPs and
  traffic; with grad, also its backward's (run with `torch.autograd.grad` as tiling does): its
  own peak, and the gradients it returns. The call is then replayed.
- Under autocast (mixed precision) nothing is replayed: its cache of casts outlives a call, so
  what one allocates depends on the calls before it.
- The second call with the key is learnt again, from its own arguments, and must agree with the
  first; if it does not, or the call did anything a replay cannot repeat (changed an input in
  place, left something allocated besides its outputs and saved tensors, recorded an output of
  transformers' output capturing, as MoE routers do, depended on a tensor requiring grad that is
  neither an argument nor one of the module's parameters), that key runs for real from then on.
  The key fixes everything the sandbox takes from the arguments (shapes, strides, dtypes, grad,
  whether each is a view; arguments sharing storage are not replayed), so what the second
  learning can find is what the key does not hold: state of the module or the process that
  changed between the first two calls (a buffer, a counter, a hook). State that changes only
  later is not seen: the replay assumes a call's effect is a function of its key, as tiling's
  slices are.
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

from hf_offload.internal import active_collector

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


@dataclass(frozen=True)
class _Argument:
    """A tensor argument, as the call is run again in a sandbox: a fresh tensor like it."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    is_view: bool  # a view of something its caller holds (tiling's slice of a leaf): held through backward


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
    return account.matmul_flops, account.attention_flops, account.traffic_bytes, account.operand_bytes, compute, by_tag


@dataclass
class _Backward:
    """A backward learnt for gradients of given shapes and strides, under the tag of its time."""

    effect: _Effect
    gradients: list[_Output | None]  # per tensor argument, then per parameter

    def same_as(self, other: _Backward) -> bool:
        return self.effect.same_as(other.effect) and self.gradients == other.gradients


@dataclass
class _Learnt:
    forward: _Effect
    structure: tuple  # per output item: ("tensor", index into outputs) or ("value", constant)
    single: bool  # the call returned one tensor, not a tuple
    outputs: list[_Output]
    saved: dict[tuple, int]  # bytes autograd saved for backward, beyond outputs and arguments, by tag
    inputs_saved: list[bool]  # per tensor argument: whether autograd saved it
    parameters: int  # how many of the module's parameters require grad
    backward: _Backward | None = None  # learnt with the call, for contiguous gradients

    def same_as(self, other: _Learnt) -> bool:
        if not (
            self.forward.same_as(other.forward)
            and self.structure == other.structure
            and self.outputs == other.outputs
            and self.saved == other.saved
            and self.inputs_saved == other.inputs_saved
            and self.parameters == other.parameters
        ):
            return False
        if (self.backward is None) != (other.backward is None):
            return False
        return self.backward is None or self.backward.same_as(other.backward)


@dataclass
class _Call:
    """What it takes to run a call again: the module, its forward, the arguments' shape, where
    it was made (the attribution's tag) and under which autocast."""

    module: nn.Module
    forward: object
    template: tuple  # (args, kwargs) with each tensor replaced by None
    arguments: list[_Argument]
    tag: tuple
    autocast: tuple


@dataclass
class _Once:
    """What is known of one kind of call (or of one kind of its backward)."""

    entry: object = None
    seen: int = 0
    never: bool = False  # runs for real


@dataclass
class _Key(_Once):
    call: _Call | None = None
    backwards: dict = field(default_factory=dict)  # (gradients' metadata, tag) -> _Once of a _Backward


class SliceMemo:
    """Installed on a model for one step: learns and replays module calls (module docstring)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.keys: dict[tuple, _Key] = {}
        self.parameters: dict[int, list[nn.Parameter]] = {}  # by module, those requiring grad
        self.learning = False
        self.replays = 0
        self.replays_by_module: dict[int, int] = {}  # by id of the module: what was replayed where
        self.real_calls = 0
        self.approximated = 0  # backwards that could not be replayed and ran again for real
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
            self.parameters.clear()

    # -- a call -----------------------------------------------------------------------------------

    def call(self, module: nn.Module, forward, args: tuple, kwargs: dict):
        if self.learning:
            return forward(*args, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            # Autocast's cache of casts outlives a call and is cleared when an autocast region ends:
            # what a call allocates then depends on what came before it. Run for real.
            return self._real(forward, args, kwargs)
        grad = torch.is_grad_enabled()
        if grad and (
            torch._C._current_autograd_node() is None
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        ):
            return forward(*args, **kwargs)
        try:
            key = call_key(module, args, kwargs, grad, self.tracker.tag)
        except _NotReplayable:
            return self._real(forward, args, kwargs)
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = _Key()
        if state.never:
            return self._real(forward, args, kwargs)
        state.seen += 1
        if state.seen <= 2:
            # Each of the first two calls is learnt from its own arguments; the first's stays, for the
            # backwards learnt later and for running the call again (_run_backward).
            call = _call_of(module, forward, args, kwargs, self.tracker.tag)
            if state.call is None:
                state.call = call
            try:
                learnt = self._learn(call, grad)
            except _NotReplayable:
                learnt = None
            if learnt is None or (state.entry is not None and not state.entry.same_as(learnt)):
                state.never = True
                return self._real(forward, args, kwargs)
            state.entry = learnt
        self.replays += 1
        self.replays_by_module[id(module)] = self.replays_by_module.get(id(module), 0) + 1
        learnt = state.entry
        if not grad:
            return _rebuild(learnt, self._replay_forward(learnt))
        tensors = [value for value in _flatten((args, kwargs)) if isinstance(value, torch.Tensor)]
        outputs = _Replay.apply(self, state, len(tensors), *tensors, *self._trainable(module))
        return _rebuild(learnt, list(outputs))

    def _real(self, forward, args: tuple, kwargs: dict):
        """A call that is not replayed runs for real, and so does everything it calls: what its
        parts' arguments share with the rest of its graph, and so how long they live, a replay of
        one part alone cannot know."""
        self.real_calls += 1
        paused, self.learning = self.learning, True
        try:
            return forward(*args, **kwargs)
        finally:
            self.learning = paused

    def _trainable(self, module: nn.Module) -> list[nn.Parameter]:
        parameters = self.parameters.get(id(module))
        if parameters is None:
            parameters = self.parameters[id(module)] = [p for p in module.parameters() if p.requires_grad]
        return parameters

    # -- learning -----------------------------------------------------------------------------------

    def _learn(self, call: _Call, grad: bool, gradients: list | None = None):
        """Run the call (and with grad its backward, for `gradients` of the given metadata, else
        contiguous ones) in a sandbox: a _Learnt, or with `gradients` a _Backward."""
        tracker = self.tracker
        outer = tracker.account
        outer_live, aside = outer.live, tracker.aside_bytes
        collector = _active_collector()
        lengths = {key: len(value) for key, value in collector.items()}
        tag = tracker.tag
        self.learning = True
        try:
            with tracker.sandbox() as account, _autocast(call.autocast), torch.set_grad_enabled(grad):
                tracker.tag = call.tag
                learnt = self._learn_in(account, call, grad, gradients, tag)
                if account.live:
                    raise _NotReplayable  # something it made outlives the call
        finally:
            self.learning = False
            tracker.tag = tag
            recorded = False
            for key, length in lengths.items():  # what the trial recorded is not the step's
                recorded |= len(collector[key]) != length
                del collector[key][length:]
        if outer is tracker.main:  # what the call put in a cache of the step's (autocast's casts) stays there
            outer_live += tracker.aside_bytes - aside
        if outer.live != outer_live or recorded:
            raise _NotReplayable  # it freed or allocated outside its own account, or recorded an output
        return learnt

    def _learn_in(self, account: Account, call: _Call, grad: bool, gradients: list | None, tag: tuple):
        tracker = self.tracker
        copies = [_like(argument, tracker) for argument in call.arguments]
        versions = [copy._version for copy in copies]
        copy_keys = [id(copy.untyped_storage()) for copy in copies]
        copy_args, copy_kwargs = _instantiate(call.template, copies)
        parameters = self._trainable(call.module) if grad else []
        start_sequence = _next_sequence_nr(tracker) if grad else 0
        base, base_tags = account.live, dict(account.live_by_tag)
        _restart(account)
        packed: set[int] = set()
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.add(id(t.untyped_storage())), t)[1], lambda t: t)
            if grad
            else contextlib.nullcontext()
        )
        with hooks:
            result = call.forward(*copy_args, **copy_kwargs)
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
        for name, nbytes in base_tags.items():
            saved[name] = saved.get(name, 0) - nbytes
        for output in described:
            saved[output.tag] -= _extent_of(output)
        saved = {name: nbytes for name, nbytes in saved.items() if nbytes}
        if not grad:
            if saved:
                raise _NotReplayable
            return _Learnt(forward_effect, structure, single, described, {}, [False] * len(copies), 0)
        if any(nbytes < 0 for nbytes in saved.values()):
            raise _NotReplayable
        _check_graph(outputs, copies, parameters, start_sequence)
        learnt = _Learnt(
            forward_effect, structure, single, described, saved, [key in packed for key in copy_keys], len(parameters)
        )
        # Backward, as tiling runs it: one autograd.grad over the slice's graph, under the tag of
        # its time, each output given its gradient (a view of the whole one: no memory of its own).
        differentiable = [tensor for tensor in outputs if tensor.requires_grad]
        if gradients is None:
            gradients = [(tuple(t.shape), t.stride(), t.dtype) for t in differentiable]
        else:
            differentiable = [t for t, given in zip(differentiable, gradients, strict=True) if given is not None]
            gradients = [given for given in gradients if given is not None]
        targets = [torch.autograd.graph.get_gradient_edge(copy) for copy in copies if copy.requires_grad]
        targets += parameters
        wanted = [copy.requires_grad for copy in copies] + [True] * len(parameters)
        if not (differentiable and targets):
            learnt.backward = _Backward(_Effect(0, "", (), "", {}, Account()), [None] * len(wanted))
            return learnt
        with tracker.host_allocations():
            given = [torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in gradients]
        # Arguments that are not views of something else are held by the graph alone, as a slice
        # tiling cuts and copies is: let go of them as the caller does.
        held = [copy for copy, argument in zip(copies, call.arguments, strict=True) if argument.is_view]
        del copies, copy_args, copy_kwargs, result
        tracker.tag = tag
        start, start_tags = account.live, dict(account.live_by_tag)
        _restart(account)
        found = iter(torch.autograd.grad(differentiable, targets, given, allow_unused=True))
        effect = _effect(account, start, start_tags)
        del differentiable, outputs, given, held
        returned = []
        for wants in wanted:
            gradient = next(found) if wants else None
            if gradient is None:
                returned.append(None)
                continue
            block = account.blocks.get(id(gradient.untyped_storage()))
            if block is None or gradient.storage_offset() or block[0] != _extent(gradient):
                raise _NotReplayable
            returned.append(_Output(tuple(gradient.shape), gradient.stride(), gradient.dtype, block[1], False))
        learnt.backward = _Backward(effect, returned)
        return learnt

    def _backward_for(self, state: _Key, gradients: tuple) -> _Backward | None:
        """What the call's backward does for gradients of this metadata, under the tag of now: the
        one learnt with the call where they are contiguous, else learnt now (twice, compared)."""
        tag = self.tracker.tag
        if (
            all(g is None or g[1] == _contiguous(g[0]) for g in gradients)
            and all(g is not None for g in gradients)
            and tag == state.call.tag
        ):
            return state.entry.backward
        once = state.backwards.get((gradients, tag))
        if once is None:
            once = state.backwards[(gradients, tag)] = _Once()
        if once.never:
            return None
        once.seen += 1
        if once.seen <= 2:
            try:
                learnt = self._learn(state.call, True, list(gradients))
            except _NotReplayable:
                learnt = None
            if learnt is None or (once.entry is not None and not once.entry.same_as(learnt.backward)):
                once.never = True
                return None
            once.entry = learnt.backward
        return once.entry

    # -- replaying ----------------------------------------------------------------------------------

    def _replay_forward(self, learnt: _Learnt) -> list[torch.Tensor]:
        tracker = self.tracker
        effect = learnt.forward
        tracker.transient(effect.peak, op=effect.op, tag=effect.tag, node=effect.node, by_tag=effect.by_tag)
        tracker.count(effect.counts)
        return [_allocate(tracker, output) for output in learnt.outputs]

    def _replay_saved(self, learnt: _Learnt) -> list[torch.Tensor]:
        return [_allocate_bytes(self.tracker, nbytes, tag) for tag, nbytes in learnt.saved.items()]

    def _replay_backward(self, backward: _Backward) -> list[torch.Tensor | None]:
        tracker = self.tracker
        effect = backward.effect
        tracker.transient(effect.peak, op=effect.op, tag=effect.tag, node=effect.node, by_tag=effect.by_tag)
        tracker.count(effect.counts)
        return [None if gradient is None else _allocate(tracker, gradient) for gradient in backward.gradients]

    def _run_backward(self, state: _Key, gradients: tuple, grads: tuple, inputs: tuple) -> list:
        """A backward that cannot be replayed: the call runs again for real, with grad, and is
        differentiated. Its outputs exist twice meanwhile (the replayed ones are still held): an
        approximation, counted in `approximated`."""
        self.approximated += 1
        call = state.call
        tensors, parameters = inputs[: len(call.arguments)], inputs[len(call.arguments) :]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        args, kwargs = _instantiate(call.template, leaves)
        paused, self.learning = self.learning, True
        try:
            with _autocast(call.autocast), torch.enable_grad():
                _structure_unused, _single, outputs = _structure(call.forward(*args, **kwargs))
        finally:
            self.learning = paused
        pairs = [(o, g) for o, g in zip([o for o in outputs if o.requires_grad], grads, strict=False) if g is not None]
        targets = [leaf for leaf in leaves if leaf.requires_grad] + list(parameters)
        found = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True))
        return [next(found) if leaf.requires_grad else None for leaf in leaves] + [next(found) for _ in parameters]


def _memo_forward(self: nn.Module, *args, **kwargs):
    memo, previous = self.__dict__[STATE_ATTR]
    forward = previous if previous is not None else types.MethodType(type(self).forward, self)
    return memo.call(self, forward, args, kwargs)


class _Replay(torch.autograd.Function):
    """A learnt call with grad: forward allocates its outputs and saved bytes, backward replays
    its backward (learnt for the gradients it is given) and returns gradients for the tensor
    arguments and the module's parameters."""

    @staticmethod
    def forward(ctx, memo: SliceMemo, state: _Key, count: int, *inputs):
        ctx.set_materialize_grads(False)
        learnt = state.entry
        ctx.memo, ctx.state = memo, state
        outputs = memo._replay_forward(learnt)
        ctx.saved = memo._replay_saved(learnt)
        # The arguments autograd saved stay alive with the graph, as in the real call.
        ctx.held = [tensor for tensor, saved in zip(inputs[:count], learnt.inputs_saved, strict=True) if saved]
        ctx.inputs = inputs
        ctx.mark_non_differentiable(*[t for t, o in zip(outputs, learnt.outputs, strict=True) if not o.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        memo, state = ctx.memo, ctx.state
        differentiable = [g for g, o in zip(grads, state.entry.outputs, strict=True) if o.requires_grad]
        metadata = tuple(None if g is None else (tuple(g.shape), g.stride(), g.dtype) for g in differentiable)
        backward = memo._backward_for(state, metadata)
        inputs, ctx.inputs = ctx.inputs, None
        if backward is not None:
            gradients = memo._replay_backward(backward)
            ctx.saved = ctx.held = None
        else:
            ctx.saved = ctx.held = None
            gradients = memo._run_backward(state, metadata, differentiable, inputs)
        return (None, None, None, *gradients)


# -- helpers ----------------------------------------------------------------------------------------


def call_key(module: nn.Module, args: tuple, kwargs: dict, grad: bool, tag: tuple) -> tuple:
    """What a call is: the module instance (layers that look alike may differ: a dense MLP before
    MoE blocks, a sliding-window layer between global ones), its arguments' metadata (whether
    each is a view included: a view's storage outlives the call's backward, an argument held by
    the graph alone is freed during it), grad mode, autocast, and where the step's attribution is.
    Arguments that share storage with one another are not replayable: the sandbox gives each a
    fresh tensor of its own."""
    storages = [id(t.untyped_storage()) for t in _flatten((args, kwargs)) if isinstance(t, torch.Tensor)]
    if len(set(storages)) != len(storages):
        raise _NotReplayable
    return (id(module), grad, _describe(args), _describe(kwargs), _autocast_state(), tag)


def _describe(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NotReplayable
        return (value.shape, value.stride(), value.dtype, value.requires_grad, value._base is not None)
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


def _like(argument: _Argument, tracker: MemoryTracker) -> torch.Tensor:
    """A fresh tensor of the argument's metadata; requiring grad as it does, through a graph of
    its own (not a leaf, so that autograd can let go of it as of the slice it stands for)."""
    copy = torch.empty_strided(argument.size, argument.stride, dtype=argument.dtype, device="meta")
    if argument.requires_grad:
        with tracker.host_allocations():
            root = torch.empty((), dtype=argument.dtype, device="meta", requires_grad=True)
        copy.copy_(root.expand(argument.size))
    return copy


_TENSOR = object()  # where a call's template had a tensor


def _call_of(module: nn.Module, forward, args: tuple, kwargs: dict, tag: tuple) -> _Call:
    def strip(value):
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        if isinstance(value, dict):
            return {name: strip(value[name]) for name in sorted(value)}
        return _TENSOR if isinstance(value, torch.Tensor) else value

    arguments = [
        _Argument(tuple(t.shape), t.stride(), t.dtype, t.requires_grad, t._base is not None)
        for t in _flatten((args, kwargs))
        if isinstance(t, torch.Tensor)
    ]
    return _Call(module, forward, (strip(args), strip(kwargs)), arguments, tag, _autocast_state())


def _instantiate(template: tuple, tensors: list) -> tuple[tuple, dict]:
    """(args, kwargs) from a call's template, its tensors put back in the order `_flatten` gives.
    (No closure: a recursive one is a reference cycle, and would keep the tensors alive.)"""
    leaves = iter(tensors)
    return _build(template[0], leaves), _build(template[1], leaves)


def _build(value, leaves: Iterator):
    if isinstance(value, (list, tuple)):
        return type(value)(_build(item, leaves) for item in value)
    if isinstance(value, dict):
        return {name: _build(value[name], leaves) for name in sorted(value)}
    return next(leaves) if value is _TENSOR else value


def _restart(account: Account) -> None:
    """Measure from what is live now: a fresh peak and counts."""
    account.peak = Peak(bytes=account.live)
    account.pending_snapshot = False
    account.clear_counts()


@contextlib.contextmanager
def _autocast(state: tuple) -> Iterator[None]:
    """The autocast state a call was made under (the CPU's flag: a CPU build cannot enable CUDA's)."""
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in state:
            if kind == "cpu" and (
                enabled != torch.is_autocast_enabled(kind) or dtype != torch.get_autocast_dtype(kind)
            ):
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        yield


def _contiguous(size: tuple) -> tuple:
    stride, step = [], 1
    for extent in reversed(size):
        stride.append(step)
        step *= max(extent, 1)
    return tuple(reversed(stride))


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
    counts.operand_bytes = account.operand_bytes
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


def _active_collector() -> dict[str, list]:
    """transformers' output-capturing lists (MoE routers' logits), if a forward is collecting."""
    collector = active_collector() or {}
    return {key: value for key, value in collector.items() if isinstance(value, list)}
