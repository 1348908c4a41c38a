"""The pure step planner: sequence lengths in, :class:`Plan` out. No ``torch`` imports here."""

from .budgets import stage_budgets
from .chunking import Chunking, SequenceBatch, balanced_split
from .coefficients import DeviceSpec, ProfileSample
from .cost import CostModel
from .dry_run import dry_run
from .lower import lower
from .partition import partition_layers
from .plan import Plan, PlanStats, Program
from .recompute import SOLVERS, InfeasiblePlanError, assign_recompute, fits, uniform_recompute
from .schedule import backward_order, build_schedule
from .simulate import SimResult, simulate
from .replicas import REPLICA_METHODS, ReplicaSplit, balance_replicas
from .strategies import PIPELINE_STRATEGIES, STRATEGIES, ideal_step_time, plan_step
from .types import Action, ActionKind, Chunk, ChunkKind, PlanError, Slice, StageLayout

__all__ = [
    "Action", "ActionKind", "Chunk", "ChunkKind", "Chunking", "CostModel", "DeviceSpec", "InfeasiblePlanError",
    "PIPELINE_STRATEGIES", "Plan", "PlanError", "PlanStats", "ProfileSample", "REPLICA_METHODS", "ReplicaSplit",
    "SOLVERS", "STRATEGIES", "SequenceBatch", "SimResult", "Slice", "StageLayout",
    "assign_recompute", "backward_order", "balance_replicas", "balanced_split", "build_schedule",
    "fits",
    "ideal_step_time", "partition_layers", "plan_step", "simulate", "stage_budgets",
    "uniform_recompute",
    "Program", "dry_run", "lower",
]
