"""Runtime: executes a :class:`~concertina_hf.planning.plan.Plan` on ``torch.distributed``.

- :class:`PipelineWrapper` (:mod:`.stage`): one pipeline stage of an HF causal LM, pruned in place;
- :class:`PipelineExecutor` (:mod:`.executor`): walks the stage's actions, returns a :class:`StepResult`;
- :mod:`.attention`: the ``"concertina"`` attention backend (packed, sliced sequences, K/V across slices);
- :mod:`.ulysses`: Ulysses sequence parallelism over the ranks of one stage (all-to-all of heads);
- :mod:`.p2p`: stage-to-stage transfers; :mod:`.memory`: measured activation memory;
- :mod:`.profiler`: the cost model fitted from the real layers, measured by :mod:`.probe`.
"""

from .attention import ATTN_IMPLEMENTATION, ChunkAttentionContext, KVStore, SliceSpec, register_attention
from .executor import PipelineExecutor, StepResult
from .memory import AllocationTracker, CudaPeakMeter, LiveTensorMeter, SavedTensorMeter
from .stage import PipelineWrapper

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AllocationTracker",
    "ChunkAttentionContext",
    "CudaPeakMeter",
    "KVStore",
    "LiveTensorMeter",
    "PipelineExecutor",
    "PipelineWrapper",
    "SavedTensorMeter",
    "SliceSpec",
    "StepResult",
    "register_attention",
]
