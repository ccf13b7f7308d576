"""TRL's own activation offloading (`activation_offloading=True` in its configs), seen from inside
a decoder layer call: TRL's trainers enter their `OffloadActivations` saved-tensor hooks around
the whole training step, so they are the active hooks when a decoder layer starts. Read from the
hooks' defining module; TRL is never imported."""

from __future__ import annotations

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
