"""Hugging Face's `kernels` library, as transformers uses it from 5.25 on (a dependency there, and
`from_pretrained(..., use_kernels=None)` means on). Read from what it leaves on modules and
classes; `kernels` is never imported.

Two of its behaviours meet ours (checked on kernels 0.19.1 with transformers 5.25.0; the entries
`kernels.kernelize` and `kernels.kernel_funcs` of `hf_offload.integrations.upstream`):

- `kernelize(model)` visits every module whose class `use_kernel_forward_from_hub` decorated
  (RMSNorm, the rotary embedding, ...) and sets that module's instance-level `forward` to a hub
  kernel's bound forward, or deletes it to fall back to the class's. transformers kernelizes in
  `from_pretrained` and again at every `train()` / `eval()` that changes the mode. A wrapper tiling
  put on such a module's forward is then gone: `instance_forward.dropped` tells it, and tiling puts
  its wrapper back on top of whatever kernelize chose (a hub kernel's forward is per token as the
  module's is).
- `use_kernelized_func(fn)` replaces a class's `__init__` (which sets `self._kernel_funcs`) and its
  `forward` (which reads it at every call). A module built while the class had another
  `__init__` (DeepSpeed's `zero.Init` puts back the `__init__` it saw when the class was created
  inside it) fails at its first forward with `AttributeError: ... '_kernel_funcs'`, with or without
  hf_offload: `check_kernel_funcs` says so, by name, before training starts.
"""

from __future__ import annotations

from torch import nn

KERNEL_FUNCS_ATTR = "_kernel_funcs"  # set on an instance by kernels' use_kernelized_func __init__


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
