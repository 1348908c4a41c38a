"""Allocation-level peak memory of a region on CPU (what ``torch.cuda.max_memory_allocated``
gives on GPUs): every tensor storage created inside the region is counted from its creation
until it is freed.

:class:`AllocationTracker` is a ``TorchDispatchMode``: for every op output it registers a weak
reference on the output's storage (once per storage), adds its bytes to a running total and
subtracts them when the storage dies. The event log is kept, so the peak can be recomputed
excluding storages that turn out to be parameter gradients (``.grad`` tensors created during
backward persist across steps, like parameters; they are static memory, not activations).
Storages alive before the region (parameters, inputs) are never counted.

It sees what autograd and checkpointing keep, the K/V and masks of the runtime, communication
buffers, temporaries of every op and gradients flowing through backward: the peak is a real
allocation peak, minus the allocator's fragmentation. Cost: one Python call per op output (tens
of microseconds), so it is used on an untimed step only.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationTracker"]


class AllocationTracker(TorchDispatchMode):
    """``with AllocationTracker() as t: ...`` then ``t.peak_bytes(exclude=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}  # event id of a live storage -> its weakref
        self._ids: dict[int, int] = {}  # id(storage object) -> event id, while alive
        self._events: list[tuple[int, int]] = []  # (+/- bytes, event id)
        self._next = 0

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_meta:
            return
        st = t.untyped_storage()
        if id(st) in self._ids and self._refs.get(self._ids[id(st)]) is not None \
                and self._refs[self._ids[id(st)]]() is st:
            return
        n = st.nbytes()
        if n == 0:
            return
        eid = self._next
        self._next += 1
        self._ids[id(st)] = eid
        self._events.append((n, eid))

        def freed(_ref, eid=eid, n=n, key=id(st)):
            self._events.append((-n, eid))
            self._refs.pop(eid, None)
            if self._ids.get(key) == eid:
                del self._ids[key]

        self._refs[eid] = weakref.ref(st, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def event_id(self, t: torch.Tensor) -> int | None:
        """The event id of a tensor's storage if it was created inside the region and is alive."""
        st = t.untyped_storage()
        eid = self._ids.get(id(st))
        ref = self._refs.get(eid) if eid is not None else None
        return eid if ref is not None and ref() is st else None

    def peak_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Peak of the live bytes created in the region, storages of ``exclude`` left out."""
        skip = {e for e in (self.event_id(t) for t in exclude if t is not None) if e is not None}
        cur = peak = 0
        for n, eid in self._events:
            if eid in skip:
                continue
            cur += n
            peak = max(peak, cur)
        return peak

    def live_bytes(self) -> int:
        return sum(n for n, _ in self._events)
