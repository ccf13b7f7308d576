"""The memory-saving modes the tools compare, by name, and the switches that put a model in one.

A mode is a base (`none`, `hf_offload`, `checkpointing`, `checkpointing+hf_offload`, the two
budget modes `..._auto`, `transformers_offload`, `trl_offload`) with optional suffixes: `+liger`
computes the loss with Liger's fused linear cross-entropy (FLCE), which never materialises the
vocabulary-wide logits; `+tiled` turns on hf_offload's sequence tiling with its defaults
(`enable_sequence_tiling()`: the MLPs, and the loss head unless Liger computes it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

MODES = (
    "none",
    "hf_offload",
    "checkpointing",
    "checkpointing+hf_offload",
    "hf_offload_auto",
    "checkpointing+hf_offload_auto",
    "transformers_offload",
    "trl_offload",
)
# The modes with hf_offload, and the same mode without it. The `_auto` ones give hf_offload a
# device-memory budget (max_device_bytes="auto"): it offloads only the layers that must move.
WITHOUT_HF_OFFLOAD = {
    "hf_offload": "none",
    "checkpointing+hf_offload": "checkpointing",
    "hf_offload_auto": "none",
    "checkpointing+hf_offload_auto": "checkpointing",
}
# Modes whose offloading is not hf_offload's and needs an accelerator (pinned memory, streams): the
# bench skips them on a machine without one, and the simulator, on the meta device, cannot run them.
NEEDS_ACCELERATOR = {
    "transformers_offload": "transformers' offload=True copies with torch's save_on_cpu, which pins host memory",
    "trl_offload": "TRL's offloading needs an accelerator's streams",
}
LIGER = "+liger"
TILED = "+tiled"
SUFFIXES = (LIGER, TILED)
ALL_MODES = MODES + tuple(mode + suffix for mode in MODES for suffix in (LIGER, TILED, LIGER + TILED))
# `hf-offload estimate`'s modes when none are given (with --checkpointing: the second).
ESTIMATE_MODES = ("none", "hf_offload", "checkpointing", "checkpointing+hf_offload")
ESTIMATE_CHECKPOINTING_MODES = ("checkpointing", "checkpointing+hf_offload")
# With a device memory and no modes given, this one too: the longest context's recipe (docs/longest_context.md).
LONGEST_CONTEXT_MODE = "checkpointing+hf_offload+tiled"


@dataclass(frozen=True)
class Mode:
    name: str
    base: str  # one of MODES
    liger: bool = False
    tiled: bool = False

    @property
    def checkpointing(self) -> bool:
        return self.base.startswith("checkpointing") or self.base == "transformers_offload"

    @property
    def hf_offload(self) -> bool:
        return self.base in WITHOUT_HF_OFFLOAD

    @property
    def budget(self) -> bool:
        return self.base.endswith("_auto")

    def without_hf_offload(self) -> str:
        return WITHOUT_HF_OFFLOAD[self.base] + (LIGER if self.liger else "") + (TILED if self.tiled else "")


def parse_mode(name: str) -> Mode:
    """"checkpointing+hf_offload+liger" -> Mode(base="checkpointing+hf_offload", liger=True); the
    suffixes in any order."""
    base, found = name, set()
    while True:
        suffix = next((s for s in SUFFIXES if base.endswith(s) and s not in found), None)
        if suffix is None:
            break
        found.add(suffix)
        base = base[: -len(suffix)]
    if base not in MODES:
        raise ValueError(f"unknown mode {name!r}; valid: {', '.join(ALL_MODES)}")
    return Mode(name, base, liger=LIGER in found, tiled=TILED in found)


def set_checkpointing(model, enabled: bool, *, offload: bool = False) -> None:
    """transformers' activation checkpointing (non-reentrant). Releases without the
    activation_checkpointing_* methods (5.17 has only gradient_checkpointing_*) have no offload=True:
    that mode is then skipped, as an ImportError says to the sweep."""
    if hasattr(model, "activation_checkpointing_enable"):
        if enabled:
            model.activation_checkpointing_enable(offload=offload)
        else:
            model.activation_checkpointing_disable()
        return
    import transformers

    if offload:
        version = transformers.__version__
        raise ImportError(f"transformers {version} has no activation_checkpointing_enable(offload=True)")
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def is_liger_flce(model) -> bool:
    """Whether Liger's FLCE is on this instance's own `forward`, the one `set_liger_flce` sets
    (`apply_liger_kernel_to_llama(model=...)` sets `model.forward = MethodType(lce_forward, model)`)."""
    from hf_offload.internal import fused_linear_cross_entropy_in_use

    return "forward" in model.__dict__ and fused_linear_cross_entropy_in_use(model)


def liger_apply_function(model_type: str):
    """Liger's `apply_liger_kernel_to_<model_type>`."""
    from hf_offload.internal import resolve

    apply = resolve("liger-kernel.apply_functions").get(model_type)
    if apply is None:
        raise ValueError(f"Liger has no kernels for model type {model_type!r}")
    return apply


def liger_flce_switches(model_type: str) -> dict[str, bool]:
    """The keyword switches of Liger's apply function for `model_type` that turn on its fused
    linear cross-entropy and nothing else (the names of the other switches differ per family):
    what the "+liger" modes run, and what the estimate's recipe passes."""
    apply = liger_apply_function(model_type)
    switches = {name: False for name, p in inspect.signature(apply).parameters.items() if isinstance(p.default, bool)}
    return {**switches, "fused_linear_cross_entropy": True}


def set_liger_flce(model, enabled: bool) -> None:
    """Compute the loss of this causal LM instance with Liger's fused linear cross-entropy, and
    nothing else of Liger's: its RMSNorm, SwiGLU and RoPE patches are left off, because they replace
    classes and module functions for every model in the process. `enabled=False` removes the
    instance's `forward` again, which restores the class's."""
    if not enabled:
        if is_liger_flce(model):
            del model.forward
        return
    if is_liger_flce(model):
        return
    if "forward" in model.__dict__:
        raise RuntimeError(f"{type(model).__name__}.forward is already replaced on this instance; Liger would hide it")
    model_type = model.config.model_type
    liger_apply_function(model_type)(model=model, **liger_flce_switches(model_type))
    if not is_liger_flce(model):
        raise RuntimeError(f"Liger's apply function for {model_type!r} did not replace forward on the instance")
