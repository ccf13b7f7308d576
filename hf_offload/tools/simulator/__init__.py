"""The memory simulator behind `hf-offload estimate`: real training steps on the meta device,
without memory or compute."""

from .step import NOT_SIMULATED, Part, PositionTable, Simulator, StepResult, Training, composition, position_table
from .tracker import MemoryTracker, Peak
from .trl import TRAINERS, TrlStep

__all__ = [
    "NOT_SIMULATED",
    "TRAINERS",
    "MemoryTracker",
    "Part",
    "Peak",
    "PositionTable",
    "Simulator",
    "StepResult",
    "Training",
    "TrlStep",
    "composition",
    "position_table",
]
