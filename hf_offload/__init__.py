"""Activation offloading for Hugging Face causal language models, in one line:

import hf_offload
model.enable_activation_offloading()
"""

from .adapters import UnsupportedModelError, register_adapter, registered_model_types, unregister_adapter
from .api import (
    _install_model_methods,
    activation_offloading_stats,
    disable_activation_offloading,
    enable_activation_offloading,
    is_activation_offloading,
)
from .config import OffloadOptions
from .engine import KEEP_REASONS, OffloadStats

__version__ = "0.1.0"

_install_model_methods()

__all__ = [
    "KEEP_REASONS",
    "OffloadOptions",
    "OffloadStats",
    "UnsupportedModelError",
    "activation_offloading_stats",
    "disable_activation_offloading",
    "enable_activation_offloading",
    "is_activation_offloading",
    "register_adapter",
    "registered_model_types",
    "unregister_adapter",
]
