"""TRL's own activation offloading (`activation_offloading=True` in its configs), seen from inside
a decoder layer call: TRL's trainers enter their `OffloadActivations` saved-tensor hooks around
the whole training step, so they are the active hooks when a decoder layer starts. Read from the
hooks' defining module; TRL is never imported."""

from __future__ import annotations

import sys

TRL_OFFLOADING_WARNING = (
    "hf_offload: TRL's activation offloading is on as well (activation_offloading=True in the SFTConfig, "
    "DPOConfig, KTOConfig or RewardConfig) around a model on which hf_offload is enabled. Both are exact, "
    "but hf_offload already offloads the decoder layers' activations and TRL's then only moves the few "
    "tensors saved outside them, at a cost in time. Set activation_offloading=False in the TRL config to "
    "keep hf_offload's, or call model.disable_activation_offloading() to keep TRL's."
)


def is_trl_hooks_module(module: str) -> bool:
    """Whether saved-tensor hooks defined in `module` (a module name) are TRL's."""
    return module == "trl" or module.startswith("trl.")


def fused_head_notice(model_name: str) -> str:
    return (
        f"hf_offload: {model_name} is trained through TRL's fused LM head (its trainers call model(..., "
        "fused_lm_head=True), which scores tokens from the backbone's last hidden states in tiles of its own): the "
        "loss head is TRL's, not sequence tiling's. Tiling keeps the decoder layers' parts and the final norm, "
        "which runs a slice at a time before TRL's head (docs/trl.md)."
    )


# TRL's fused forward calls the backbone directly: a few frames of torch's module call lie between.
_FUSED_FORWARD_DEPTH = 12


def in_trl_fused_head() -> bool:
    """Whether the caller runs inside TRL's fused LM head (the forward `trl.trainer.utils.
    add_fused_lm_head` puts on a model, called with `fused_lm_head=True`), read from the call stack
    a few frames up. TRL is never imported."""
    frame = sys._getframe(1)
    for _ in range(_FUSED_FORWARD_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == "_fused_forward" and is_trl_hooks_module(frame.f_globals.get("__name__", "")):
            return bool(frame.f_locals.get("fused_lm_head"))
        frame = frame.f_back
    return False

