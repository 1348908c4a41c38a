"""Measured activation memory of one pipeline stage.

:class:`SavedTensorMeter` is a context manager that installs
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for backward while it
is active is counted once per storage (a view and its base count once, parameters and buffers
never), and uncounted when autograd releases it (the graph node is freed after its backward).
Tensors the runtime holds itself (stage inputs and outputs kept for backward, K/V stashed for
later slices, their gradients) are added with :meth:`SavedTensorMeter.hold` under a tag and
removed with :meth:`SavedTensorMeter.release`; both sources share the same per-storage count, so
a tensor both saved by autograd and held is counted once. ``peak_bytes`` is the maximum of the
live total since the last :meth:`reset`.

What it does not see: tensors saved inside a checkpointed region (checkpoint's own hooks take
precedence; they are dropped anyway) and the transient activations of the layer being
recomputed during backward, temporaries that autograd does not save (an op's workspace), and the
gradients flowing through backward. On CUDA all of these are real allocations, so there the
meter reads ``torch.cuda.max_memory_allocated`` minus the allocation at :meth:`reset` instead.

Cost: one Python call per saved tensor and one more when autograd drops it (2.75 us over no hook
in a loop of tiny ops, a hook that does nothing 1.25 us; in whole steps of a 10M-parameter Llama
1.1% / 3.7% / 6.6% of a step of chunks of 1024 / 256 / 64 tokens:
``benchmarks/studies/runtime_overhead.py``); nothing on CUDA. The
executor runs it only on the steps whose figure is used (``PipelineExecutor.run_step``'s
``measure_memory``).

:class:`LiveTensorMeter` counts every live tensor storage instead (a ``TorchDispatchMode``): on
CPU the stand-in for the CUDA allocator, so it sees what :class:`SavedTensorMeter` misses (it
reads 30-58% below it under full recompute). Cost: one Python call per op, forward and backward.
:class:`CudaPeakMeter` is its CUDA counterpart (the allocator's current and peak bytes, same
interface); the profiler takes one or the other by device.

:class:`AllocationTracker` is the benchmarks' allocation-level peak of a whole step: it keeps an
event log, so the peak can be recomputed after the fact leaving out tensors that turn out to be
static memory (parameter gradients created during the step's backward). See its docstring for
how its count differs from :class:`LiveTensorMeter`'s.
"""

from __future__ import annotations

import threading
import weakref
from typing import Hashable, Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationTracker", "CudaPeakMeter", "LiveTensorMeter", "SavedTensorMeter"]


def _storage_key(t: torch.Tensor) -> int | tuple[str, int]:
    """A storage's identity: its address (CPU), or device and address (elsewhere)."""
    ptr = t.untyped_storage().data_ptr()
    return ptr if t.is_cpu else (str(t.device), ptr)


class _Packed:
    """What autograd keeps instead of the tensor; uncounts it when autograd drops it. The fields
    are set by :meth:`SavedTensorMeter._pack` (no ``__init__``: one Python call less per saved
    tensor)."""

    __slots__ = ("tensor", "meter", "key")

    def __del__(self) -> None:
        if self.key is not None:
            try:
                self.meter._dec(self.key)
            except Exception:  # interpreter shutdown
                pass


class SavedTensorMeter:
    """Counts the bytes of tensors saved for backward plus explicitly held tensors.

    >>> import torch
    >>> meter = SavedTensorMeter()
    >>> x = torch.ones(256, requires_grad=True)
    >>> with meter:
    ...     y = (x * 2).sin()          # sin saves its input: 1 KiB
    >>> meter.current_bytes, meter.peak_bytes
    (1024, 1024)
    >>> del y
    >>> meter.current_bytes, meter.peak_bytes
    (0, 1024)
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.use_cuda_stats = self.device.type == "cuda"
        self._excluded = {_storage_key(t) for t in exclude}
        self._lock = threading.Lock()
        self._live: dict[int | tuple[str, int], list[int]] = {}  # storage -> [nbytes, refcount]
        # tag -> [(storage key, tensor)]: the reference keeps the storage (and so its address,
        # the key) alive while it is counted
        self._held: dict[Hashable, list[tuple[int | tuple[str, int], torch.Tensor]]] = {}
        self._current = 0
        self._peak = 0
        self._cuda_base = 0
        self._hooks = None

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "SavedTensorMeter":
        if not self.use_cuda_stats:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None

    # ------------------------------------------------------------------ accounting
    def reset(self) -> None:
        """Start a new peak from the current live total."""
        with self._lock:
            self._peak = self._current
        if self.use_cuda_stats:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)

    @property
    def current_bytes(self) -> int:
        if self.use_cuda_stats:
            return torch.cuda.memory_allocated(self.device) - self._cuda_base
        return self._current

    @property
    def peak_bytes(self) -> int:
        if self.use_cuda_stats:
            return torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        return self._peak

    def hold(self, tag: Hashable, *tensors: torch.Tensor | None) -> None:
        """Count ``tensors`` (once per storage) until :meth:`release` of ``tag``; adds to a tag
        already held."""
        if self.use_cuda_stats:
            return
        keys = self._held.setdefault(tag, [])
        for t in tensors:
            if t is None:
                continue
            key = self._inc(t)
            if key is not None:
                keys.append((key, t))

    def release(self, tag: Hashable) -> None:
        for key, _ in self._held.pop(tag, ()):
            self._dec(key)

    def release_all(self) -> None:
        for tag in list(self._held):
            self.release(tag)

    def _inc(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self._excluded:
            return None
        nbytes = t.untyped_storage().nbytes()
        if nbytes == 0:
            return None
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [nbytes, 1]
                self._current += nbytes
                if self._current > self._peak:
                    self._peak = self._current
            else:
                entry[1] += 1
        return key

    def _dec(self, key) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[key]
                self._current -= entry[0]

    def _pack(self, t: torch.Tensor) -> _Packed:
        # _inc inlined: this runs for every tensor autograd saves
        p = _Packed()
        p.tensor, p.meter, p.key = t, self, None
        st = t.untyped_storage()
        ptr = st.data_ptr()
        key = ptr if t.is_cpu else (str(t.device), ptr)
        if key in self._excluded:
            return p
        nbytes = st.nbytes()
        if nbytes == 0:
            return p
        p.key = key
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [nbytes, 1]
                cur = self._current = self._current + nbytes
                if cur > self._peak:
                    self._peak = cur
            else:
                entry[1] += 1
        return p

    @staticmethod
    def _unpack(p: _Packed) -> torch.Tensor:
        return p.tensor


class LiveTensorMeter(TorchDispatchMode):
    """Peak bytes of all tensor storages created while it is active and still alive: on CPU,
    the stand-in for the CUDA allocator's peak (which :class:`SavedTensorMeter` is not:
    it sees only tensors saved for backward outside checkpointed regions and those the executor
    holds).

    Every op's outputs are intercepted (a ``TorchDispatchMode``, forward and backward alike); a
    storage not seen before and not aliasing an input of the op is counted from its creation
    until it is freed (a ``weakref.finalize`` on the storage). Storages that existed before (and
    ``exclude``: parameters, their ``.grad``, buffers) are never counted, nor are views of them.
    So transients count too: the activations of a layer recomputed in backward, gradients in
    flight, temporaries inside an op's decomposition (not a fused kernel's own workspace).

    Cost: a Python call per op (a few microseconds): fine for tests and tiny models, not for
    timing.

    >>> import torch
    >>> x = torch.ones(256)
    >>> with LiveTensorMeter() as live:
    ...     y = x * 2           # 1 KiB
    ...     z = (y + 1).sum()   # a 1 KiB temporary, alive until the 4-byte sum exists
    ...     del y
    >>> live.current_bytes, live.peak_bytes
    (4, 2052)
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self._excluded = {_storage_ptr(t) for t in exclude if t is not None}
        self._live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def reset(self) -> None:
        """Start a new peak from the current live total."""
        self.peak_bytes = self.current_bytes

    def _free(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            nbytes = st.nbytes()
            if nbytes == 0 or key in self._live or key in self._excluded or key in inputs:
                continue
            self._live[key] = nbytes
            self.current_bytes += nbytes
            weakref.finalize(st, self._free, key)
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes
        return out


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class CudaPeakMeter:
    """The CUDA allocator's view of a region, with :class:`LiveTensorMeter`'s interface:
    ``current_bytes`` and ``peak_bytes`` above what was allocated on entering (``peak_bytes``
    since entering or the last :meth:`reset`). Counts every allocation on ``device``, the
    caller's included. Cost: a device synchronisation on entering and per :meth:`reset`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> "CudaPeakMeter":
        self.reset()
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def reset(self) -> None:
        """Start a new peak from the current allocation."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.base


class AllocationTracker(TorchDispatchMode):
    """Allocation-level peak memory of a region on CPU (what ``torch.cuda.max_memory_allocated``
    gives on GPUs): ``with AllocationTracker() as t: ...`` then ``t.peak_bytes(exclude=...)``.

    For every op output it registers a weak reference on the output's storage (once per
    storage), logs its bytes and logs them again, negated, when the storage dies. The event log
    is kept, so :meth:`peak_bytes` can leave out storages identified only at the end (parameter
    gradients created during backward persist across steps, like parameters: static memory,
    not activations). It sees what autograd and checkpointing keep, the runtime's K/V and
    masks, communication buffers, temporaries of every op and gradients flowing through
    backward: a real allocation peak, minus the allocator's fragmentation. CPU tensors only.

    Unlike :class:`LiveTensorMeter` it does not skip op outputs that alias a storage created
    before the region: an op returning a view of a parameter (``weight.t()`` inside a linear
    layer) counts that parameter's storage, from then on while it lives (on a two-layer Llama
    of hidden size 64, 360 KB of its 427 KB of parameters). Pass the parameters (and buffers)
    in ``exclude`` of :meth:`peak_bytes` for an activation peak: the benchmarks' ``alloc_peak``
    figures are counted so, the pipeline's and the single-process baseline's alike.

    Cost: one Python call per op output (tens of microseconds): for untimed steps only.
    """

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
        """Bytes created in the region and still alive."""
        return sum(n for n, _ in self._events)
