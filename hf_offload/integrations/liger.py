"""Whether a model's loss is computed by Liger Kernel's fused linear cross-entropy.

Read from the model, never by importing liger_kernel (an optional extra): what Liger leaves
behind is enough. With `fused_linear_cross_entropy=True`, Liger's `apply_liger_kernel_to_<family>`
replaces the causal LM's `forward` with one of its own, defined in `liger_kernel.transformers.model`
(`lce_forward` for llama, qwen2, mistral and gemma): on the instance (`model.forward`) when given
`model=`, which is also what `TrainingArguments(use_liger_kernel=True)` does through
`_apply_liger_kernel_to_instance`; on the class (`LlamaForCausalLM.forward`) when called before the
model exists. The class's `forward` found on an instance patched the first way still belongs to
transformers, which is why that alone cannot tell. Liger's RMSNorm, SwiGLU and RoPE patches
replace decoder-layer internals and leave the loss alone.
"""

from __future__ import annotations

from torch import nn

from ..adapters import unwrap_model

# Every causal LM forward Liger installs lives in a module under this package, and it installs
# one only when fused_linear_cross_entropy is on (its plain `cross_entropy=True` option replaces
# torch's cross_entropy and keeps transformers' forward and logits).
_LIGER_FORWARDS_PACKAGE = "liger_kernel.transformers.model."


def _defining_module(function: object) -> str:
    # Through bound methods (Liger binds with types.MethodType) and functools.wraps chains
    # (accelerate's hooks replace forward with a partial that keeps __wrapped__).
    seen: set[int] = set()
    while id(function) not in seen:
        seen.add(id(function))
        inner = getattr(function, "__func__", None) or getattr(function, "__wrapped__", None)
        if inner is None:
            break
        function = inner
    return getattr(function, "__module__", None) or ""


def fused_linear_cross_entropy_in_use(model: nn.Module) -> bool:
    """True when `model`'s training loss is computed by Liger's fused linear cross-entropy,
    which never materialises the full logits: its forward returns `logits=None` when training
    with labels. (In eval mode or without labels Liger's forward computes the logits as usual.)

    Works on a transformers model, a PEFT wrapper or a DDP wrapper around one. Liger must have
    been applied with `fused_linear_cross_entropy=True` (its default for the families hf_offload
    supports): by `apply_liger_kernel_to_<family>(model=...)`, by the same call before the
    model was built, or by `TrainingArguments(use_liger_kernel=True)` once `Trainer.train()`
    has started (the Trainer applies Liger there, not when it is constructed).
    """
    target = unwrap_model(model)
    instance_forward = target.__dict__.get("forward")
    forward = instance_forward if instance_forward is not None else type(target).forward
    return _defining_module(forward).startswith(_LIGER_FORWARDS_PACKAGE)
