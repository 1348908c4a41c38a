"""The pure step planner: sequence lengths in, :class:`Plan` out. No ``torch`` imports here."""

from .cost import CostModel, DeviceSpec, ProfileSample
from .schedule import backward_order, build_schedule
from .types import Action, ActionKind, Chunk, ChunkKind, Plan, PlanError, PlanStats, Slice, StageLayout

__all__ = [
    "Action", "ActionKind", "Chunk", "ChunkKind", "CostModel", "DeviceSpec", "Plan", "PlanError",
    "PlanStats", "ProfileSample", "Slice", "StageLayout", "backward_order", "build_schedule",
]
