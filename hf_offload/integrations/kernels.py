"""Hugging Face's `kernels` library, as transformers uses it from 5.25 on (a dependency there, and
`from_pretrained(..., use_kernels=None)` means on). Read from what it leaves on modules and
classes; `kernels` is never imported.

Two of its behaviours meet ours (checked on kernels 0.19.1 with transformers 5.25.0; the entries
`kernels.kernelize_replaces_forward` and `kernels.kernel_funcs` of `hf_offload.integrations.upstream`):

- `kernelize(model)` visits every module whose class `use_kernel_forward_from_hub` decorated (the
  class then has `kernel_layer_name`: RMSNorm, the rotary embedding, ...) and sets that module's
  instance-level `forward` to a hub kernel's bound forward, or deletes it to fall back to the
  class's. transformers kernelizes in `from_pretrained` and again at every `train()` / `eval()`
  that changes the mode. A wrapper tiling put on such a module's forward is then gone, and the
  module would run whole: `replaced_by_kernelize` tells it, and tiling puts its wrapper back on top
  of whatever kernelize chose (a hub kernel's forward is per token as the module's is).
- `use_kernelized_func(fn)` replaces a class's `__init__` (which sets `self._kernel_funcs`) and its
  `forward` (which reads it at every call). A module built while the class had another
  `__init__` (DeepSpeed's `zero.Init` puts back the `__init__` it saw when the class was created
  inside it) fails at its first forward with `AttributeError: ... '_kernel_funcs'`, with or without
  hf_offload: `check_kernel_funcs` says so, by name, before training starts.
"""

from __future__ import annotations

import types

from torch import nn

KERNEL_LAYER_ATTR = "kernel_layer_name"  # set on a class by kernels' use_kernel_forward_from_hub
KERNEL_FUNCS_ATTR = "_kernel_funcs"  # set on an instance by kernels' use_kernelized_func __init__


def is_kernel_layer(module: nn.Module) -> bool:
    """Whether `kernelize` rewrites this module's forward: its class was decorated with kernels'
    `use_kernel_forward_from_hub`."""
    return hasattr(type(module), KERNEL_LAYER_ATTR)


def replaced_by_kernelize(module: nn.Module) -> bool:
    """Whether the module's instance-level forward is what `kernelize` leaves: none (it fell back to
    the class's forward) or a layer class's `forward` bound to the module (a hub kernel's), so that
    nothing installed on the forward before it is reached any more. False for any other forward (a
    wrapper that keeps the one it wraps, as accelerate's hooks do), and for a module whose class
    kernelize does not visit."""
    if not is_kernel_layer(module):
        return False
    current = module.__dict__.get("forward")
    if current is None:
        return True
    if not isinstance(current, types.MethodType) or current.__self__ is not module:
        return False
    function = current.__func__
    # A class's own `forward` (qualname "RMSNorm.forward"), not a closure made around another one.
    return function.__name__ == "forward" and "<locals>" not in function.__qualname__


def reads_kernel_funcs(cls: type) -> bool:
    """Whether the class's forward is the one kernels' `use_kernelized_func` installs, which reads
    `self._kernel_funcs` at every call."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and hasattr(forward, "__wrapped__") and KERNEL_FUNCS_ATTR in code.co_names


def check_kernel_funcs(model: nn.Module) -> None:
    """Raise a clear error for a module whose forward reads `_kernel_funcs` (kernels'
    `use_kernelized_func`) but which was built without it: its first forward fails whatever runs
    around it."""
    for name, module in model.named_modules():
        if reads_kernel_funcs(type(module)) and KERNEL_FUNCS_ATTR not in module.__dict__:
            cls = type(module).__name__
            raise RuntimeError(
                f"hf_offload: {cls} ({name}) was built without the `{KERNEL_FUNCS_ATTR}` its forward reads: its "
                f"class is decorated with the kernels library's use_kernelized_func (transformers >= 5.25 does so), "
                f"whose __init__ sets it, but {cls} was built with another __init__. DeepSpeed's zero.Init does this "
                f"when the modeling module is first imported inside `with deepspeed.zero.Init(...)`: on leaving, it "
                f"puts back the __init__ the class had before kernels decorated it. The model fails at its first "
                f"forward with or without hf_offload. Import the model class before entering zero.Init (as "
                f"transformers' from_pretrained and from_config do): `import {type(module).__module__}`."
            )
