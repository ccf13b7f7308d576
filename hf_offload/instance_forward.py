"""Instance-level forward wrappers, installed and removed one way by offloading (on decoder
layers) and tiling (on the modules it tiles and on the causal LM).

A wrapper is an `InstanceForward`: called, it runs `wrapper(module, *args, **kwargs)`. It shows
the signature of the forward it wraps, because transformers reads `inspect.signature(model.forward)`
to choose which dataset columns the Trainer keeps and whether `generate` may pass
`logits_to_keep`; and it pickles and deep-copies as a reference to the wrapper function and the
module, so `torch.save(model)` and `copy.deepcopy(model)` work, the copy wrapped like the
original (each state object decides what of itself a copy keeps).

Something may wrap a module's forward again after us (accelerate's autocast wrapper on the
model's forward, a hook library); removing ours from under it would break its chain. So removal
leaves ours in place as a pass-through (its state marked inactive), and enabling again reuses it
through the new state instead of stacking a second wrapper.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable

from torch import nn


class InstanceForward:
    """`module.forward` while a wrapper is installed: a bound method in all but type.

    `__func__` and `__self__` are there for code that unbinds and rebinds a forward (accelerate
    wraps `model.forward.__func__` under mixed precision); `__func__` carries the wrapped
    signature too, so the signature survives that rewrapping."""

    __slots__ = ("wrapper", "module", "state_attr", "_signature", "_function")

    def __init__(self, wrapper: Callable, module: nn.Module, state_attr: str) -> None:
        self.wrapper = wrapper
        self.module = module
        self.state_attr = state_attr
        self._signature: inspect.Signature | None = None
        self._function: Callable | None = None

    def __call__(self, *args, **kwargs):
        return self.wrapper(self.module, *args, **kwargs)

    def __reduce__(self):
        return (InstanceForward, (self.wrapper, self.module, self.state_attr))

    @property
    def __self__(self) -> nn.Module:
        return self.module

    @property
    def __name__(self) -> str:
        return "forward"

    @property
    def __signature__(self) -> inspect.Signature:
        if self._signature is None:
            self._signature = inspect.signature(self._wrapped())
        return self._signature

    @property
    def __func__(self) -> Callable:
        if self._function is None:
            wrapper = self.wrapper

            def forward(module, *args, **kwargs):
                return wrapper(module, *args, **kwargs)

            # The wrapped forward's parameters after the module's own.
            parameters = list(self.__signature__.parameters.values())
            forward.__signature__ = self.__signature__.replace(
                parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *parameters]
            )
            forward.__module__, forward.__name__, forward.__qualname__ = (
                wrapper.__module__,
                wrapper.__name__,
                wrapper.__qualname__,
            )
            forward._hf_offload_wrapper = wrapper
            self._function = forward
        return self._function

    def _wrapped(self) -> Callable:
        """The forward this one wraps: an earlier instance-level forward, or the class's."""
        state = self.module.__dict__.get(self.state_attr)
        previous = getattr(state, "previous_forward", None)
        return previous if previous is not None else types.MethodType(type(self.module).forward, self.module)


class BoundMethod:
    """A module-level function bound to a module, as `types.MethodType` binds it, but pickled as a
    reference to the function and the module (a bound method pickles as the attribute of its
    function's name, which the module does not have)."""

    __slots__ = ("function", "module")

    def __init__(self, function: Callable, module: nn.Module) -> None:
        self.function = function
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

    def __reduce__(self):
        return (BoundMethod, (self.function, self.module))


def wraps(module: nn.Module, wrapper: Callable) -> bool:
    """Whether `wrapper` is the module's instance-level forward, on top of any other (also when
    code that unbinds forwards has bound our `__func__` to the module again)."""
    current = module.__dict__.get("forward")
    if isinstance(current, InstanceForward):
        return current.wrapper is wrapper and current.module is module
    function = getattr(current, "__func__", None)
    return isinstance(current, types.MethodType) and getattr(function, "_hf_offload_wrapper", None) is wrapper


def install(module: nn.Module, wrapper: Callable, state_attr: str, make_state: Callable[[object], object]) -> None:
    """Wrap `module.forward` with `wrapper(self, *args, **kwargs)`, which reads its state from
    `state_attr`: `make_state(previous_forward)`, the previous being the instance-level forward
    it wraps (None: the class's). Installed already (on top, or under another wrapper), only the
    state is replaced."""
    existing = module.__dict__.get(state_attr)
    if existing is not None:
        setattr(module, state_attr, make_state(existing.previous_forward))
        return
    setattr(module, state_attr, make_state(module.__dict__.get("forward")))
    module.forward = InstanceForward(wrapper, module, state_attr)
    module._replicate_for_data_parallel = BoundMethod(_replicate, module)


def rebind(module: nn.Module, wrapper: Callable, state_attr: str) -> None:
    """Give `module` a wrapper of its own over the forward its state names."""
    module.forward = InstanceForward(wrapper, module, state_attr)


def _replicate(self: nn.Module) -> nn.Module:
    """torch's `_replicate_for_data_parallel`, on a module that carries one of our wrappers:
    nn.DataParallel copies each module's `__dict__` into a replica on another GPU, where our wrapper,
    its state and the forward it wraps would still be bound to this module (its weights on the first
    GPU). The replica gets its own: the state's `for_replica(replica)` where it has one (offloading's
    layer slot: caches of the replica's own), else a copy, the wrapped forward bound to the replica."""
    replica = type(self)._replicate_for_data_parallel(self)
    current = self.__dict__.get("forward")
    if isinstance(current, InstanceForward) and current.module is self:
        state = self.__dict__[current.state_attr]
        own = state.for_replica(replica) if hasattr(state, "for_replica") else copy.copy(state)
        if own is not state:
            own.previous_forward = _bound_to(state.previous_forward, self, replica)
        setattr(replica, current.state_attr, own)
        rebind(replica, current.wrapper, current.state_attr)
    replica._replicate_for_data_parallel = BoundMethod(_replicate, replica)
    return replica


def _bound_to(forward, original: nn.Module, replica: nn.Module):
    """`forward` as the replica's, where it was bound to `original`."""
    if isinstance(forward, InstanceForward) and forward.module is original:
        return InstanceForward(forward.wrapper, replica, forward.state_attr)
    if isinstance(forward, types.MethodType) and forward.__self__ is original:
        return types.MethodType(forward.__func__, replica)
    return forward


def dropped(module: nn.Module) -> bool:
    """Whether the module's instance-level forward is one that reaches no wrapper installed before
    it: none at all (deleted), or a class's own `forward` bound to the module. That is what kernels'
    `kernelize` leaves (transformers >= 5.25 runs it at every train() / eval() that changes the
    mode; `integrations.kernels`), and Liger's instance patches. Not a wrapper that keeps the one it
    wraps (accelerate's hooks, a closure)."""
    current = module.__dict__.get("forward")
    if current is None:
        return True
    if not isinstance(current, types.MethodType) or current.__self__ is not module:
        return False
    function = current.__func__
    # A class's own `forward` (qualname "RMSNorm.forward"), not a closure made around another one.
    return function.__name__ == "forward" and "<locals>" not in function.__qualname__


def reinstate(module: nn.Module, wrapper: Callable, state_attr: str) -> bool:
    """Put `wrapper` back on top of a module whose forward was replaced by one that dropped ours
    (`dropped`): ours then wraps what replaced it. True when it did; False when ours is in place,
    or absent, or another wrapper holds it."""
    state = module.__dict__.get(state_attr)
    if state is None or wraps(module, wrapper) or not dropped(module):
        return False
    state.previous_forward = module.__dict__.get("forward")
    rebind(module, wrapper, state_attr)
    return True


def remove(module: nn.Module, wrapper: Callable, state_attr: str) -> bool:
    """Put back what `wrapper` replaced and delete its state (True); with another wrapper on top
    of ours, keep ours as a pass-through (`state.active = False`) and return False. Where ours
    was dropped (`dropped`: kernelize), the forward that replaced it stays and our state goes."""
    state = module.__dict__.get(state_attr)
    if state is None:
        return True
    if dropped(module):
        delattr(module, state_attr)
        module.__dict__.pop("_replicate_for_data_parallel", None)
        return True
    if not wraps(module, wrapper):
        state.active = False
        return False
    if state.previous_forward is None:
        del module.forward
    else:
        module.forward = state.previous_forward
    delattr(module, state_attr)
    module.__dict__.pop("_replicate_for_data_parallel", None)
    return True
