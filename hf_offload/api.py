"""Enable, disable and inspect activation offloading on a model instance.

Joins the engine (which knows nothing of transformers) to the adapters (which know only where
the decoder layers are). All state lives on the model: one attribute on the root model and,
on each decoder layer, one attribute plus an instance-level `forward` wrapper. The class is
never patched: transformers' GradientCheckpointingLayer checks `type(self).forward` to decide
whether to checkpoint, and an instance wrapper leaves that test, and checkpointing, intact
while putting the offload scope outside the checkpoint.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from . import auto_budget, instance_forward
from .adapters import find_attention, find_mlp, find_norms, innermost, is_linear_like, resolve_layers, unwrap_model
from .compiling import under_torch_compile
from .config import OffloadOptions, reject_positional
from .engine import ActivationOffloader, OffloadStats, in_backward
from .engine.recompute import tensors_in
from .integrations.kernels import check_kernel_funcs
from .integrations.liger import fused_linear_cross_entropy_in_use
from .integrations.trl import TRL_OFFLOADING_WARNING, is_trl_hooks_module
from .integrations.upstream import announce, present

logger = logging.getLogger("hf_offload")

MODEL_STATE_ATTR = "_hf_offload"
LAYER_STATE_ATTR = "_hf_offload_layer"

class _Controller:
    """Per-model state: options, the engine, the wrapped layers."""

    def __init__(self, model: nn.Module, options: OffloadOptions) -> None:
        self.model = model
        self.options = options
        self.engine = ActivationOffloader(**self.engine_options(options))
        self.adapter = ""
        self.layers: list[nn.Module] = []
        self.paused = False  # the layers were re-wrapped mid-pass: the rest of the pass runs plain
        self.unmovable: list[int] | None = None  # layer ids found inside a checkpoint we cannot wrap
        self.installations = 0
        self._outside: _ModuleCache = _ModuleCache()
        self.embeddings_hook = None  # marks the output the model's own forward gets from its input embeddings
        self.anchor: torch.Tensor | None = None  # what layer 0's detoured input depends on for autograd

    def __getstate__(self) -> dict:
        # A pickled or deep-copied model offloads as this one does, from a fresh start: what was
        # learnt about the layers and their storages belongs to this model's process.
        return {**self.__dict__, "paused": False, "unmovable": None, "_outside": _ModuleCache()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _watch_module_structure()  # a new process has not watched any structure yet

    def engine_options(self, options: OffloadOptions) -> dict[str, object]:
        engine_options = options.engine_options()
        if engine_options["max_device_bytes"] == "auto":
            engine_options["max_device_bytes"] = functools.partial(_auto_device_budget, self)
        return engine_options

    def tensors_outside_layers(self) -> Iterator[torch.Tensor]:
        """The parameters and buffers of every module not inside a decoder layer, read when a
        forward pass first needs them. Each layer's own are read at its call instead: FSDP2 frees
        a layer's unsharded weights after its forward, and later layers reuse that memory."""
        return self._outside.tensors(self._modules_outside_layers)

    def _modules_outside_layers(self) -> list[nn.Module]:
        inside = {id(module) for layer in self.layers for module in layer.modules()}
        return [module for module in self.model.modules() if id(module) not in inside]

    def configure(self, options: OffloadOptions) -> None:
        self.options = options
        self.engine.configure(**self.engine_options(options))

    def move_outside_checkpoint(self, slot: _LayerSlot, name: str) -> None:
        """Called when a wrapped layer runs inside a checkpoint (in torch.utils.checkpoint's
        forward, or recomputed by a reentrant one in backward), where the checkpoint would never
        see the tensors our hooks take. Checkpoint wrappers applied after enabling (FSDP's or
        accelerate's activation checkpointing) are found again and wrapped instead, from the next
        forward pass on; the rest of this pass runs as without us."""
        with self.engine._lock:  # nn.DataParallel replicas can get here at once
            if slot.installation != self.installations:
                return  # another replica's thread has moved the wrappers already
            current = [id(layer) for layer in self.layers]
            if current == self.unmovable:
                return
            try:
                _adapter, layers = resolve_layers(self.model)
            except Exception:  # a structure no adapter knows: never fail the step over this
                layers = self.layers
            if [id(layer) for layer in layers] == current:
                self.unmovable = current  # checked once; enabling again checks anew
                self.engine._warn_once("inside_checkpoint", _CANNOT_WRAP_CHECKPOINT.format(name=name))
                return
            _uninstall(self)
            _install(self, layers)
            self.paused = True
        self.engine._warn_once(
            "moved_outside_checkpoint",
            "hf_offload: the decoder layers were put in checkpoint wrappers after offloading was enabled; "
            "hf_offload now wraps the wrappers and offloads the checkpoint inputs from the next step on "
            "(this step ran with checkpointing alone).",
        )


_CANNOT_WRAP_CHECKPOINT = (
    "hf_offload: decoder layer {name} runs inside a checkpoint that hf_offload cannot wrap from outside "
    "(torch.utils.checkpoint called around the layer by other code, or torch.distributed's composable "
    "checkpoint(layer), which enters the checkpoint in a forward pre-hook); it offloads nothing from layers "
    "run inside a checkpoint. Use model.activation_checkpointing_enable() or torch.distributed's "
    "checkpoint_wrapper instead, which hf_offload wraps from outside."
)


class _ModuleCache:
    """The parameter and buffer dicts of a list of modules, rebuilt only when one of those
    modules registered a submodule, parameter or buffer since: walking a LoRA model's module
    tree takes milliseconds, too long for every layer call. The dicts themselves are read at
    each use, so a parameter swapped in place (FSDP2 swaps sharded and gathered ones by writing
    `module._parameters` directly) or given new storage (`model.to`, ZeRO-3) is seen."""

    __slots__ = ("dicts", "generation")

    def __init__(self) -> None:
        self.dicts: list[dict[str, torch.Tensor | None]] = []
        self.generation = -1

    def __reduce__(self):
        return (_ModuleCache, ())  # a copy builds its own

    def tensors(self, build: Callable[[], list[nn.Module]]) -> Iterator[torch.Tensor]:
        if self.generation != _structure_generation[0]:
            modules = build()
            self.dicts = [d for module in modules for d in (module._parameters, module._buffers) if d]
            self.generation = _structure_generation[0]
            _watched_modules.update(modules)
        for tensors in self.dicts:
            for tensor in tensors.values():
                if tensor is not None:
                    yield tensor


# Bumped by torch's global registration hooks when a module some cache was built from registers
# a submodule, parameter or buffer (PEFT's get_peft_model, FSDP1 or checkpoint wrapping, a module
# replaced by assignment); the containers a forward pass builds and drops (transformers slices
# its ModuleList of layers) are not watched.
_structure_generation = [0]
_watched_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # weak: a dead module's id is reused
_registration_hooks: list = []


def _structure_changed(module: nn.Module, _name: str, _value: object) -> None:
    # Under torch.compile the hook is traced into the graph (transformers registers layers into a
    # sliced ModuleList every forward): no structure of ours changes inside a compiled region.
    if torch.compiler.is_compiling():
        return
    if module in _watched_modules:
        _structure_generation[0] += 1


def _watch_module_structure() -> None:
    if not _registration_hooks:
        registrations = torch.nn.modules.module
        _registration_hooks.extend(
            register(_structure_changed)
            for register in (
                registrations.register_module_module_registration_hook,
                registrations.register_module_parameter_registration_hook,
                registrations.register_module_buffer_registration_hook,
            )
        )


class _LayerSlot:
    __slots__ = (
        "controller", "position", "previous_forward", "installation", "name", "_modules", "_device_probe", "late_hook",
        "attention_hook", "part_hooks",
    )  # fmt: skip

    def __init__(self, controller: _Controller, position: int, previous_forward: object, layer: nn.Module) -> None:
        self.controller = controller
        self.position = position
        # An instance-level forward that was there before us (accelerate hooks set one).
        self.previous_forward = previous_forward
        self.installation = controller.installations  # which _install put it there
        self.name = f"{position} ({type(layer).__name__})"
        self._modules = _ModuleCache()
        self._device_probe: tuple[nn.Module, str] | None = None
        self.late_hook = None  # on the attention's first projection: the end of the layer's peak in backward
        self.attention_hook = None  # on the attention block: the end of what the recompute saves for it
        # Before the layer's norms and MLP: in the recompute, the first of them to run after the attention
        # block is where what was saved for the attention leaves the device.
        self.part_hooks: list = []

    def for_replica(self, replica: nn.Module) -> _LayerSlot:
        """The same slot for an nn.DataParallel replica of the layer, with caches of its own."""
        if self.controller is None:  # a pass-through left behind by disabling: nothing to cache
            return self
        slot = _LayerSlot(self.controller, self.position, self.previous_forward, replica)
        slot.installation = self.installation
        return slot

    def tensors(self, layer: nn.Module) -> Iterator[torch.Tensor]:
        """The layer's parameters and buffers as they are now."""
        return self._modules.tensors(lambda: list(layer.modules()))

    def device(self, layer: nn.Module, args: tuple, kwargs: dict) -> torch.device | None:
        """Where the layer computes: its parameters' device, read from one parameter found once
        (by module and name, so that a parameter replaced since, as accelerate's offloading does,
        is read anew). Inputs can still be on the previous layer's device when accelerate's hooks
        (device_map="auto") move them inside the call."""
        probe = self._device_probe
        if probe is not None:
            parameter = probe[0]._parameters.get(probe[1])
            if parameter is not None and parameter.device.type != "meta":
                return parameter.device
        for module in layer.modules():
            for name, parameter in module._parameters.items():
                if parameter is not None and parameter.device.type != "meta":
                    self._device_probe = (module, name)
                    return parameter.device
        for value in itertools.chain(args, kwargs.values()):
            if isinstance(value, torch.Tensor):
                return value.device
        return None


def _outer_saved_tensors_hooks_module() -> str | None:
    """The module defining the pack hook of the saved_tensors_hooks context active around this
    call (None when there is none). There is no public API for this; if torch drops the private
    call, the check is skipped."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is None:
        return None
    return getattr(hooks[0], "__module__", None) or ""


def _runs_inside_checkpoint(controller: _Controller, first: bool) -> bool:
    """Read when a decoder layer starts a training forward. TRL's trainers enter their
    OffloadActivations context (activation_offloading=True) around the whole training step;
    torch.utils.checkpoint's non-reentrant forward is an outer context when a checkpoint wrapper
    was put around an already wrapped layer."""
    module = _outer_saved_tensors_hooks_module()
    if module is None:
        return False
    if first and is_trl_hooks_module(module):
        controller.engine._warn_once("trl", TRL_OFFLOADING_WARNING)
    return module == "torch.utils.checkpoint"


_UNDER_COMPILE = (
    "hf_offload runs the offload scope around each decoder layer eagerly, so torch.compile splits the "
    "graph there (each decoder layer compiles on its own) and fullgraph=True cannot be used with "
    "activation offloading; see hf_offload's docs/compile.md"
)


class _EagerScope:
    """The engine's layer scope, entered and left outside torch.compile: dynamo must not trace
    the engine (host buffers, copies, streams, events) into graphs of its own."""

    __slots__ = ("controller", "slot", "layer", "args", "kwargs", "group", "hooks")

    def __init__(self, controller: _Controller, slot: _LayerSlot, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        self.controller, self.slot, self.layer, self.args, self.kwargs = controller, slot, layer, args, kwargs
        self.group = None
        self.hooks = None

    @torch.compiler.disable(reason=_UNDER_COMPILE)
    def __enter__(self) -> None:
        controller, slot, layer = self.controller, self.slot, self.layer
        first = slot.position == 0
        # In backward our wrapper runs only when a reentrant checkpoint around it recomputes the
        # layer (transformers' checkpointing recomputes the class forward, inside us).
        if in_backward() or _runs_inside_checkpoint(controller, first):
            controller.move_outside_checkpoint(slot, slot.name)
            return
        group = controller.engine.enter_layer(
            training=True,
            device=slot.device(layer, self.args, self.kwargs),
            starts_pass=first,
            keep=slot.position >= len(controller.layers) - controller.options.keep_last_layers,
            protected=functools.partial(slot.tensors, layer),
            pass_protected=controller.tensors_outside_layers,
            tokens=_tokens(self.args, self.kwargs) if first else None,
            late_point=slot.late_hook is not None and _checkpointed(layer),
        )
        if group is None:
            return
        _scope_the_recompute(layer)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack)
        self.hooks.__enter__()
        self.group = group

    @torch.compiler.disable(reason=_UNDER_COMPILE)
    def __exit__(self, *exc_info) -> None:
        if self.group is not None:
            self.hooks.__exit__(*exc_info)
            self.controller.engine.exit_layer(self.group, self.slot.name)


# Set on the output of the input embeddings when a forward of the model they belong to called them.
MODELS_EMBEDDINGS_ATTR = "_hf_offload_models_embeddings"
_MODULE_CALL_FILE = nn.Module.__call__.__code__.co_filename  # torch's Module.__call__ and hooks' machinery


def _mark_the_models_embeddings(module: nn.Module, args, output) -> None:
    """Forward hook on the input embeddings (registered after PEFT's, which makes their output
    require grad under checkpointing): the output is the model's own when the forward that called
    the embeddings is that of a model whose input embeddings they are (the backbone's, a composite
    model's, a replica's under nn.DataParallel). Read from the caller's frame, not from hooks around
    the model's calls: nothing is left to go stale when a KeyboardInterrupt ends a forward (torch
    runs always_call hooks for an Exception only), nor shared between the threads of replicas. A
    user who calls the embeddings themselves and passes the result as `inputs_embeds` keeps its
    gradient (one the model made, taken from its outputs and passed back, would not)."""
    if not isinstance(output, torch.Tensor) or torch.compiler.is_compiling():
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == _MODULE_CALL_FILE:
        frame = frame.f_back
    caller = frame.f_locals.get("self") if frame is not None else None
    if not isinstance(caller, nn.Module) or not callable(getattr(caller, "get_input_embeddings", None)):
        return
    try:
        models_own = caller.get_input_embeddings() is module
    except Exception:  # a module of the user's with such a method that fails: not the model's forward
        return
    if models_own:
        setattr(output, MODELS_EMBEDDINGS_ATTR, True)


class _Detour(torch.autograd.Function):
    """The embeddings' output as layer 0 takes it, no longer a leaf of the graph.

    With frozen embeddings and checkpointing, PEFT makes the embeddings' output require grad
    (`enable_input_require_grads`): a leaf, which autograd's AccumulateGrad node holds until the
    graph is freed, so layer 0's checkpoint input stayed on the device whatever was copied. Its
    gradient goes nowhere anyone reads (the tensor is the model's own, dropped after forward), so
    layer 0 takes a detached alias of it, made part of the graph through a scalar anchor: the
    same values, the same gradients for every parameter, and an input that offloading frees."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor = (anchor.dtype, anchor.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.anchor
        return None, torch.zeros((), dtype=dtype, device=device)


# Off only to compare with measurements made before it existed (the simulator's H200 check).
DETOUR_EMBEDDINGS_OUTPUT = True


@torch.compiler.disable(reason=_UNDER_COMPILE)
def _detoured_input(controller: _Controller, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Layer 0's arguments, its hidden states detoured (`_Detour`) where they are the output the
    model's own forward got from its embeddings (`_mark_the_models_embeddings`) and a leaf that
    requires grad; else as given. An `inputs_embeds` the user made, with the embeddings or
    otherwise, reaches layer 0 undetoured, so its gradient arrives in its `.grad`, and as a leaf
    of the graph it stays on the device."""
    if not DETOUR_EMBEDDINGS_OUTPUT:
        return args, kwargs
    positional = bool(args)
    hidden = args[0] if positional else kwargs.get("hidden_states")
    models_own = isinstance(hidden, torch.Tensor) and getattr(hidden, MODELS_EMBEDDINGS_ATTR, False)
    if not (models_own and hidden.is_leaf and hidden.requires_grad):
        return args, kwargs
    anchor = controller.anchor
    if anchor is None:
        anchor = controller.anchor = torch.zeros((), requires_grad=True)
    detoured = _Detour.apply(hidden.detach(), anchor)
    return ((detoured, *args[1:]), kwargs) if positional else (args, {**kwargs, "hidden_states": detoured})


def _checkpointed(layer: nn.Module) -> bool:
    """The layer's activations are recomputed in backward: transformers' checkpointing, or a
    checkpoint wrapper around it."""
    return bool(getattr(innermost(layer), "gradient_checkpointing", False)) or _CHECKPOINTED in layer._modules


_CHECKPOINTED = "_checkpoint_wrapped_module"


def _after_attention_projection(engine, module: nn.Module, args, output) -> None:
    """Forward hook on a layer's first attention projection. In forward, the earlier layers' copies
    to the host let go of their sources before the attention runs, at long context
    (`ActivationOffloader.release_before_attention`). The gradient of its output arrives in
    backward once the attention's backward, the layer's peak, is done, and the layers before it
    may come back then (`ActivationOffloader.prefetch_point`). Hooked on the graph backward runs
    through: the forward's (a non-reentrant checkpoint's recompute only refills saved tensors),
    or a reentrant checkpoint's recompute. Under torch.compile it does nothing (traced as such,
    it leaves the compiled graph as it would be without offloading), and the layers before come
    back at the layer's backward start."""
    if torch.compiler.is_compiling():
        return
    backward = in_backward()
    if not backward:
        engine.release_before_attention()
    if not (isinstance(output, torch.Tensor) and output.requires_grad):
        return
    group = engine.backward_group() if backward else engine.forward_group()
    if group is not None and group.late_point:
        output.register_hook(functools.partial(_past_the_peak, engine, weakref.ref(group)))


_CHECKPOINTING_FUNC = "_gradient_checkpointing_func"  # transformers' GradientCheckpointingLayer calls it


class _RecomputeScoped:
    """A layer's `_gradient_checkpointing_func` (transformers sets one on each layer), passing it the
    layer's forward wrapped so that its recompute in backward runs inside the engine's
    `recompute_scope`: what the recompute saves for the attention's backward waits on the host while
    the MLP's backward runs (`engine.recompute`). The checkpoint itself, reentrant or not, is
    transformers' and torch's, unchanged. A copy or a pickle of the layer gets the function it wraps."""

    __slots__ = ("original", "layer")

    def __init__(self, original: Callable, layer: nn.Module) -> None:
        self.original = original
        self.layer = weakref.ref(layer)

    def __call__(self, function, *args, **kwargs):
        return self.original(functools.partial(_recompute_in_scope, self.layer, function), *args, **kwargs)

    def __reduce__(self):
        return (_unwrapped, (self.original,))

    def __deepcopy__(self, memo: dict):
        from copy import deepcopy

        return deepcopy(self.original, memo)


def _unwrapped(original: Callable) -> Callable:
    return original


def _scope_the_recompute(layer: nn.Module) -> None:
    """Put `_RecomputeScoped` in place on a checkpointed layer (again after transformers set a new
    function, or on a copy of the layer)."""
    inner = innermost(layer)
    function = inner.__dict__.get(_CHECKPOINTING_FUNC)
    if function is None:
        return
    if isinstance(function, _RecomputeScoped):
        if function.layer() is layer:
            return
        function = function.original
    inner.__dict__[_CHECKPOINTING_FUNC] = _RecomputeScoped(function, layer)


def _unscope_the_recompute(layer: nn.Module) -> None:
    inner = innermost(layer)
    function = inner.__dict__.get(_CHECKPOINTING_FUNC)
    if isinstance(function, _RecomputeScoped):
        inner.__dict__[_CHECKPOINTING_FUNC] = function.original


def _recompute_in_scope(layer_ref: weakref.ref, function, *args, **kwargs):
    """The layer's forward as the checkpoint calls it: in forward as is; in backward (the recompute)
    inside the engine's recompute scope for the layer whose backward is running."""
    if not in_backward():
        return function(*args, **kwargs)
    layer = layer_ref()
    slot = layer.__dict__.get(LAYER_STATE_ATTR) if layer is not None else None
    controller = slot.controller if slot is not None else None
    group = controller.engine.backward_group() if controller is not None else None
    if group is None or torch.compiler.is_compiling():
        return function(*args, **kwargs)
    inputs = tensors_in((args, kwargs, getattr(function, "args", ()), getattr(function, "keywords", {})), [])
    with controller.engine.recompute_scope(group, inputs, functools.partial(slot.tensors, layer)):
        return function(*args, **kwargs)


def _after_attention_block(engine, module: nn.Module, args, output) -> None:
    """Forward hook on a layer's attention block. In forward, and in a reentrant checkpoint's
    recompute (the graph backward runs through), the gradient of its output is hooked: it arrives
    once the MLP's backward and the post-attention norm's are done, and before any of the attention's
    backward runs, and what the recompute parked comes back then (`engine.restore_recomputed`). In a
    recompute, what was saved for the attention leaves the device here (`engine.park_recomputed`), its
    output excepted: with tiling the post-attention norm's and the MLP's forwards run whole in the
    recompute (each with its slice's float32 work), the peak of a long sequence."""
    if torch.compiler.is_compiling():
        return
    hidden = output[0] if isinstance(output, (tuple, list)) and output else output
    scope = None
    if in_backward():
        group = engine.backward_group()
        scope = engine.active_recompute(group) if group is not None else None
        if scope is None:
            return
        scope.end_window(tensors_in(output, []))
        if scope.outer is not None:
            # Non-reentrant: the recompute's graph is never backpropagated; the forward's hook is.
            engine.park_recomputed(scope, keep=())
            return
    else:
        group = engine.forward_group()
    if group is not None and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(functools.partial(_attention_gradient, engine, weakref.ref(group)))
        group.attention_hooked = True
    if scope is not None:
        engine.park_recomputed(scope, keep=())


def _before_a_later_part(engine, module: nn.Module, args, kwargs) -> None:
    """Forward pre-hook on a layer's norms and MLP. In a checkpoint's recompute, after the attention
    block returned (and what it saved was parked): anything parked that this part is called with
    comes back before it runs (an MLP in parallel with the attention takes the input norm's output,
    which the attention's projections saved; `engine.restore_read`)."""
    if torch.compiler.is_compiling() or not in_backward():
        return
    group = engine.backward_group()
    scope = engine.active_recompute(group) if group is not None else None
    if scope is not None and not scope.window and group.parked:
        engine.restore_read(group, tensors_in((args, kwargs), []))


def _attention_gradient(engine, group: weakref.ref, grad: torch.Tensor) -> None:
    layer_group = group()
    if layer_group is not None:
        engine.restore_recomputed(layer_group)


def _past_the_peak(engine, group: weakref.ref, grad: torch.Tensor) -> None:
    layer_group = group()
    if layer_group is not None:
        engine.prefetch_point(layer_group)


def _tokens(args: tuple, kwargs: dict) -> int | None:
    """Tokens in a pass, from the first decoder layer's hidden states (batch x sequence x hidden)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 and hidden.shape[-1]:
        return hidden.numel() // hidden.shape[-1]
    return None


_EVAL_MODE_WITH_GRAD = (
    "hf_offload: {model} ran a forward with grad in eval mode, where activation offloading does nothing "
    "(transformers' checkpointing is off there too): its decoder layers kept their activations on the device. To "
    "offload them, train in training mode (model.train()), with dropout turned off in the config if that is why the "
    "model is in eval mode (attention_dropout=0.0, LoRA's lora_dropout=0.0)"
)


def _offloaded_forward(self: nn.Module, *args, **kwargs):
    # Bound to the layer by an InstanceForward, so that copy.deepcopy and pickling rebind it to the copy.
    slot: _LayerSlot = self._hf_offload_layer
    # The class's function and self, not type(self).forward.__get__(self): after a graph break
    # dynamo rebuilds such a bound method as `self.forward`, which is this wrapper (endless recursion).
    forward = slot.previous_forward
    if forward is None:
        forward = functools.partial(type(self).forward, self)
    controller = slot.controller
    if controller is None:  # disabled while another wrapper still holds this one
        return forward(*args, **kwargs)
    if controller.paused:
        if slot.position != 0:
            return forward(*args, **kwargs)
        controller.paused = False
    # Evaluation, no_grad and generate(): the engine does nothing, so nothing of it runs.
    if not (self.training and torch.is_grad_enabled()):
        if slot.position == 0 and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            model = type(controller.model).__name__
            controller.engine._warn_once("eval_mode", _EVAL_MODE_WITH_GRAD.format(model=model))
        return forward(*args, **kwargs)
    if slot.position == 0:
        if under_torch_compile():  # the first layer speaks for the pass
            controller.engine._warn_once("compile", "hf_offload: " + _UNDER_COMPILE)
        args, kwargs = _detoured_input(controller, args, kwargs)
    with _EagerScope(controller, slot, self, args, kwargs):
        return forward(*args, **kwargs)


def _install(controller: _Controller, layers: Sequence[nn.Module]) -> None:
    unique = list(dict.fromkeys(layers))  # a layer listed twice must not wrap its own wrapper
    controller.installations += 1
    for position, layer in enumerate(unique):
        # Ours already (on top, or left as a pass-through under a later wrapper): a new slot, never
        # a second wrapper.
        instance_forward.install(
            layer,
            _offloaded_forward,
            LAYER_STATE_ATTR,
            lambda previous, position=position, layer=layer: _LayerSlot(controller, position, previous, layer),
        )
        attention = find_attention(layer)  # it looks through wrappers itself
        projection = next((c for c in attention.children() if is_linear_like(c)), None) if attention else None
        slot = layer.__dict__[LAYER_STATE_ATTR]
        if projection is not None and slot.late_hook is None:
            slot.late_hook = projection.register_forward_hook(
                functools.partial(_after_attention_projection, controller.engine)
            )
        if attention is not None and slot.attention_hook is None:
            slot.attention_hook = attention.register_forward_hook(
                functools.partial(_after_attention_block, controller.engine)
            )
        if attention is not None and not slot.part_hooks:
            inside = set(attention.modules())
            parts = [norm for norm in find_norms(layer) if norm not in inside] + [find_mlp(layer)]
            hook = functools.partial(_before_a_later_part, controller.engine)
            slot.part_hooks = [
                part.register_forward_pre_hook(hook, with_kwargs=True)
                for part in dict.fromkeys(parts)
                if part is not None
            ]
    controller.layers = unique


def _uninstall(controller: _Controller) -> None:
    for layer in controller.layers:
        slot: _LayerSlot | None = layer.__dict__.get(LAYER_STATE_ATTR)
        if slot is None:
            continue
        if slot.late_hook is not None:
            slot.late_hook.remove()
            slot.late_hook = None
        if slot.attention_hook is not None:
            slot.attention_hook.remove()
            slot.attention_hook = None
        for handle in slot.part_hooks:
            handle.remove()
        slot.part_hooks = []
        _unscope_the_recompute(layer)
        if instance_forward.wraps(layer, _offloaded_forward):
            if slot.previous_forward is None:
                del layer.forward
            else:
                layer.forward = slot.previous_forward
            delattr(layer, LAYER_STATE_ATTR)
            layer.__dict__.pop("_replicate_for_data_parallel", None)
        else:
            # Something wrapped our wrapper after we installed it; removing ours would break its
            # chain, so ours stays as a pass-through.
            slot.controller = None
            logger.warning(
                "hf_offload: %s.forward was wrapped again after offloading was enabled; "
                "left a pass-through wrapper in place",
                type(layer).__name__,
            )
    controller.layers = []


def _auto_device_budget(controller: _Controller, device: torch.device, tokens: int | None) -> int:
    """The budget for this step: free device memory, less AUTO_BUDGET_MARGIN_SHARE of the total,
    the larger of the loss head's predicted peak and one layer's full activations (its working
    memory, and the layer a checkpoint recomputes in backward), and the gradients backward will
    still allocate."""
    try:
        free, total = auto_budget.device_memory(device)
    except (RuntimeError, AttributeError, NotImplementedError, AssertionError, ValueError) as error:
        controller.engine._warn_once(
            "auto_budget",
            f"hf_offload: max_device_bytes='auto' cannot read the free memory of {device} ({error}); "
            "every layer is offloaded, as without a budget",
        )
        return 0
    reserved = int(total * auto_budget.AUTO_BUDGET_MARGIN_SHARE) + _missing_gradient_bytes(controller)
    if tokens is not None:
        reserved += _predicted_step_bytes(controller, tokens)
    return max(free - reserved, 0)


def _missing_gradient_bytes(controller: _Controller) -> int:
    """Bytes of the gradients of trainable parameters that have none yet (set_to_none=True frees
    them every step): backward allocates them while activations are still on the device."""
    tensors = [controller.tensors_outside_layers()]
    for layer in controller.layers:
        slot = layer.__dict__.get(LAYER_STATE_ATTR)
        if slot is not None:
            tensors.append(slot.tensors(layer))
    return sum(
        tensor.nbytes
        for tensor in itertools.chain.from_iterable(tensors)
        if isinstance(tensor, nn.Parameter) and tensor.requires_grad and tensor.grad is None
    )


def _predicted_step_bytes(controller: _Controller, tokens: int) -> int:
    """The larger of the loss head (fused or not) and one layer's full activations for `tokens`
    tokens (`auto_budget.predicted_step_bytes`); where the config does not tell (no transformers-
    style config, no hidden or vocabulary size), 0 and one warning saying what to pass."""
    model = controller.model
    try:
        return auto_budget.predicted_step_bytes(
            getattr(model, "config", None),
            dtype=getattr(model, "dtype", torch.float32),
            tokens=tokens,
            fused_loss=fused_linear_cross_entropy_in_use(model),
        )
    except (TypeError, ValueError, AttributeError) as error:
        controller.engine._warn_once(
            "auto_reserve",
            f"hf_offload: max_device_bytes='auto' cannot predict what {type(model).__name__}'s loss head and "
            f"recomputed layer need beyond the offloaded activations ({error}): it reserves only its margin of "
            f"{auto_budget.AUTO_BUDGET_MARGIN_SHARE:.0%} of the device, which may be too little; pass "
            "max_device_bytes=<bytes> (hf-offload estimate --model PATH tells what a step needs)",
        )
        return 0


def enable_activation_offloading(model: nn.Module, *positional: object, **options: object) -> None:
    """Offload the tensors autograd saves inside each decoder layer to host memory.

    Options (keyword-only) are described in `hf_offload.OffloadOptions`. Calling it again
    reconfigures; it never stacks wrappers. Works on a PEFT model, and before
    `get_peft_model` (LoRA layers created later are handled).
    """
    reject_positional("enable_activation_offloading", positional, OffloadOptions.option_names())
    parsed = OffloadOptions.from_kwargs(**options)
    if parsed.max_device_bytes == "auto":
        auto_budget.check_device_memory_readable()
    target = unwrap_model(model)
    _adapter, layers = resolve_layers(target)  # raises before anything is changed
    check_kernel_funcs(target)
    if "trl" in sys.modules and not present("trl.offloading_hooks"):  # TRL's own offloading goes unnoticed
        announce("trl.offloading_hooks")
    controller: _Controller | None = target.__dict__.get(MODEL_STATE_ATTR)
    if controller is None:
        controller = _Controller(target, parsed)
        setattr(target, MODEL_STATE_ATTR, controller)
    else:
        _uninstall(controller)
        controller.configure(parsed)
    controller.adapter = _adapter
    _watch_module_structure()
    _install(controller, layers)
    embeddings = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    if isinstance(embeddings, nn.Module) and controller.embeddings_hook is None:
        controller.embeddings_hook = embeddings.register_forward_hook(_mark_the_models_embeddings)
    if not target.training:
        logger.info(
            "hf_offload: %s is in eval mode; offloading engages once it trains (model.train(), which "
            "Trainer calls) and does nothing in eval mode or under no_grad",
            type(target).__name__,
        )
    # A model not yet moved to an existing accelerator (Trainer and accelerate move it later).
    on_cpu = all(p.device.type == "cpu" for p in target.parameters()) and not torch.accelerator.is_available()
    if on_cpu and not parsed.simulate_on_cpu:
        controller.engine.note_no_accelerator()


def disable_activation_offloading(model: nn.Module) -> None:
    """Remove every wrapper and attribute that enabling added. A no-op if not enabled."""
    target = unwrap_model(model)
    controller: _Controller | None = target.__dict__.get(MODEL_STATE_ATTR)
    if controller is None:
        return
    _uninstall(controller)
    if controller.embeddings_hook is not None:
        controller.embeddings_hook.remove()
        controller.embeddings_hook = None
    delattr(target, MODEL_STATE_ATTR)
    controller.engine.close()  # the disk tier's file and threads, the host pool's free buffers


def is_activation_offloading(model: nn.Module) -> bool:
    """Read from the modules themselves: True when any decoder layer carries our wrapper."""
    target = unwrap_model(model)
    return any(
        getattr(module.__dict__.get(LAYER_STATE_ATTR), "controller", None) is not None for module in target.modules()
    )


def activation_offloading_stats(model: nn.Module) -> OffloadStats:
    """What was offloaded and kept in the last training step (see `OffloadStats`)."""
    target = unwrap_model(model)
    controller: _Controller | None = target.__dict__.get(MODEL_STATE_ATTR)
    if controller is None:
        raise RuntimeError(
            f"activation offloading is not enabled on this {type(target).__name__}; "
            "call model.enable_activation_offloading() first"
        )
    return controller.engine.stats()
