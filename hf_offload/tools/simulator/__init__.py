"""The memory simulator behind `hf-offload estimate`: real training steps on the meta device,
without memory or compute."""

from .step import NOT_SIMULATED, Part, Simulator, StepResult, Training, composition
from .tracker import MemoryTracker, Peak
from .trl import TRAINERS, TrlStep

__all__ = [
    "NOT_SIMULATED",
    "TRAINERS",
    "MemoryTracker",
    "Part",
    "Peak",
    "Simulator",
    "StepResult",
    "Training",
    "TrlStep",
    "composition",
]
