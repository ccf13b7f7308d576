"""Instance-level forward wrappers, installed and removed one way by offloading (on decoder
layers) and tiling (on the modules it tiles and on the causal LM).

Something may wrap a module's forward again after us (accelerate's autocast wrapper on the
model's forward, a hook library); removing ours from under it would break its chain. So removal
leaves ours in place as a pass-through (its state marked inactive), and enabling again reuses it
through the new state instead of stacking a second wrapper.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn


def wraps(module: nn.Module, wrapper: Callable) -> bool:
    """Whether `wrapper` is the module's instance-level forward, on top of any other."""
    current = module.__dict__.get("forward")
    return isinstance(current, types.MethodType) and current.__func__ is wrapper


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
    module.forward = types.MethodType(wrapper, module)


def remove(module: nn.Module, wrapper: Callable, state_attr: str) -> bool:
    """Put back what `wrapper` replaced and delete its state (True); with another wrapper on top
    of ours, keep ours as a pass-through (`state.active = False`) and return False."""
    state = module.__dict__.get(state_attr)
    if state is None:
        return True
    if not wraps(module, wrapper):
        state.active = False
        return False
    if state.previous_forward is None:
        del module.forward
    else:
        module.forward = state.previous_forward
    delattr(module, state_attr)
    return True
