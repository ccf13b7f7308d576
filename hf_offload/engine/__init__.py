"""The offload engine. Deliberately free of transformers imports."""

from .offloader import ActivationOffloader, in_backward
from .stats import KEEP_REASONS, OffloadStats

__all__ = ["KEEP_REASONS", "ActivationOffloader", "OffloadStats", "in_backward"]
