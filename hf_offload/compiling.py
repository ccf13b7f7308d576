"""Whether code runs inside a torch.compile'd region, for the parts of hf_offload that run eagerly
there (the offload scope, sequence tiling) and say once what that means."""

from __future__ import annotations

import torch


@torch.compiler.disable(recursive=False, reason="hf_offload reads whether torch.compile is active")
def under_torch_compile() -> bool:
    """Whether the caller runs inside a torch.compile'd region. Dynamo does not trace hf_offload's
    eager parts, so torch.compiler.is_compiling() is False there; what remains set is dynamo's
    frame callback (private: no public API tells). recursive=False keeps the callback set here."""
    try:
        return torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None
    except AttributeError:
        return False
