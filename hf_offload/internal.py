"""The small interface hf_offload's own tools (`hf_offload.tools`: the `hf-offload` command, the
benchmarks, the memory simulator) use beyond the public API. Not for users: these names may
change without notice. The product never imports the tools; the tools reach into the product
only through the public names and these."""

from .adapters import resolve_layers, unwrap_model
from .auto_budget import device_memory, predicted_step_bytes, simulated_device
from .engine.planner import plan as plan_device_budget
from .engine.streams import MetaStreams, device_streams, empty_host_cache
from .integrations.liger import fused_linear_cross_entropy_in_use
from .integrations.transformers_outputs import active_collector

__all__ = [
    "MetaStreams",
    "active_collector",
    "device_memory",
    "device_streams",
    "empty_host_cache",
    "fused_linear_cross_entropy_in_use",
    "plan_device_budget",
    "predicted_step_bytes",
    "resolve_layers",
    "simulated_device",
    "unwrap_model",
]
