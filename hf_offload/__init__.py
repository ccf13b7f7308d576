"""Activation offloading for Hugging Face causal language models, in one line:

import hf_offload
model.enable_activation_offloading()

and sequence tiling of the MLPs and the loss head: model.enable_sequence_tiling().
"""

# Importing hf_offload imports neither torch nor transformers (about 9 s together): each public
# name is imported from its home at first use (PEP 562), and the model methods are added to
# PreTrainedModel when transformers defines it (model_methods.py). So the `hf-offload` command,
# whose module is inside this package, checks its arguments before paying for them.

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import model_methods

__version__ = "0.1.0"

# Each public name's home module (tests/test_lazy_import.py holds this, __all__ and the imports
# for type checkers at the end to the same names).
_HOMES = {
    "UnsupportedModelError": ".adapters",
    "register_adapter": ".adapters",
    "registered_model_types": ".adapters",
    "unregister_adapter": ".adapters",
    "activation_offloading_stats": ".api",
    "disable_activation_offloading": ".api",
    "enable_activation_offloading": ".api",
    "is_activation_offloading": ".api",
    "OffloadOptions": ".config",
    "TilingOptions": ".config",
    "KEEP_REASONS": ".engine",
    "OffloadStats": ".engine",
    "disable_sequence_tiling": ".tiling",
    "enable_sequence_tiling": ".tiling",
    "is_sequence_tiling": ".tiling",
}

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

model_methods.install()


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(_importlib.import_module(_HOMES[name], __name__), name)
    elif name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:  # a submodule, as `hf_offload.api` was after `import hf_offload` when this file imported it
        try:
            value = _importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


if _TYPE_CHECKING:  # what type checkers and editors see
    from .adapters import UnsupportedModelError, register_adapter, registered_model_types, unregister_adapter
    from .api import (
        activation_offloading_stats,
        disable_activation_offloading,
        enable_activation_offloading,
        is_activation_offloading,
    )
    from .config import OffloadOptions, TilingOptions
    from .engine import KEEP_REASONS, OffloadStats
    from .tiling import disable_sequence_tiling, enable_sequence_tiling, is_sequence_tiling
