"""The small interface hf_offload's own tools (`hf_offload.tools`: the `hf-offload` command, the
benchmarks, the memory simulator) use beyond the public API. Not for users: these names may
change without notice. The product never imports the tools; the tools reach into the product
only through the public names and these."""

import contextlib
from collections.abc import Iterator

from . import api
from .adapters import find_final_norm, resolve_layers, unwrap_model
from .auto_budget import device_memory, predicted_step_bytes, simulated_device
from .engine.offloader import place_layers
from .engine.planner import TierPlan
from .engine.planner import plan as plan_device_budget
from .engine.streams import MetaStreams, device_streams, empty_host_cache
from .integrations.liger import fused_linear_cross_entropy_in_use
from .integrations.transformers_outputs import active_collector
from .integrations.upstream import UpstreamChanged, present, replaced, resolve


@contextlib.contextmanager
def longest_context_pieces(
    *, heads: bool = True, final_norm: bool = True, embeddings: bool = True, late_prefetch: bool = True
) -> Iterator[None]:
    """Within this block (for models enabled in it), each piece of the longest-context recipe on
    or off, to measure what each buys: attention tiled over heads, the final norm tiled (chained
    with the tiled loss where lm_head takes its output; off, it runs whole), layer 0 taking the
    frozen embeddings' output detoured, the layer before coming back after the current layer's
    attention backward. Every piece is on by default."""
    from .engine import offloader
    from .tiling import attention, loss

    saved = (attention.SPLITTABLE, loss.CHAIN_FINAL_NORM, api.DETOUR_EMBEDDINGS_OUTPUT, offloader.LATE_PREFETCH_BYTES)
    attention.SPLITTABLE = saved[0] if heads else ()
    loss.CHAIN_FINAL_NORM = final_norm
    api.DETOUR_EMBEDDINGS_OUTPUT = embeddings
    offloader.LATE_PREFETCH_BYTES = saved[3] if late_prefetch else 2**62
    try:
        yield
    finally:
        attention.SPLITTABLE, loss.CHAIN_FINAL_NORM, api.DETOUR_EMBEDDINGS_OUTPUT, offloader.LATE_PREFETCH_BYTES = saved


def place_last_pass(model, *, host_bytes: int, disk_bytes: int) -> tuple[TierPlan, list[int], int]:
    """Where the disk tier's planner puts the copies of `model`'s last forward pass for these host
    and disk budgets: `place_tiers` with the engine's staging, on the bytes that pass's layer calls
    took, as the engine plans its next pass. Also those bytes (one entry per layer call) and how many
    leading layer calls were offloaded."""
    controller = unwrap_model(model).__dict__.get(api.MODEL_STATE_ATTR)
    if controller is None:
        raise RuntimeError("activation offloading is not enabled on this model")
    layer_bytes, offloaded = controller.engine.pass_host_bytes()
    plan = place_layers(layer_bytes, offloaded, host_bytes=host_bytes, disk_bytes=disk_bytes)
    return plan, layer_bytes, offloaded


__all__ = [
    "MetaStreams",
    "TierPlan",
    "UpstreamChanged",
    "active_collector",
    "device_memory",
    "device_streams",
    "empty_host_cache",
    "find_final_norm",
    "fused_linear_cross_entropy_in_use",
    "longest_context_pieces",
    "place_last_pass",
    "place_layers",
    "plan_device_budget",
    "predicted_step_bytes",
    "present",
    "replaced",
    "resolve",
    "resolve_layers",
    "simulated_device",
    "unwrap_model",
]
