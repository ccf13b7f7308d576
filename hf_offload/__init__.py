"""Activation offloading for Hugging Face causal language models, in one line:

import hf_offload
model.enable_activation_offloading()

and sequence tiling of the MLPs and the loss head: model.enable_sequence_tiling().
"""

from .adapters import UnsupportedModelError, register_adapter, registered_model_types, unregister_adapter
from .api import (
    _install_model_methods,
    activation_offloading_stats,
    disable_activation_offloading,
    enable_activation_offloading,
    is_activation_offloading,
)
from .config import OffloadOptions, TilingOptions
from .engine import KEEP_REASONS, OffloadStats
from .tiling import _install_model_methods as _install_tiling_methods
from .tiling import disable_sequence_tiling, enable_sequence_tiling, is_sequence_tiling

__version__ = "0.1.0"

_install_model_methods()
_install_tiling_methods()

__all__ = [
    "KEEP_REASONS",
    "OffloadOptions",
    "OffloadStats",
    "TilingOptions",
    "UnsupportedModelError",
    "activation_offloading_stats",
    "disable_activation_offloading",
    "disable_sequence_tiling",
    "enable_activation_offloading",
    "enable_sequence_tiling",
    "is_activation_offloading",
    "is_sequence_tiling",
    "register_adapter",
    "registered_model_types",
    "unregister_adapter",
]
