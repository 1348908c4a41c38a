"""Each pipeline stage's own random stream, for the dropout of its layers.

HF's ``Trainer`` seeds every process alike (``set_seed(args.seed)``), which is right for its
data-parallel ranks (they hold the whole model). Pipeline stages hold *different* layers: with
one shared seed, layer ``i`` of stage 0 and layer ``i`` of stage 1 would draw the very same
dropout masks, where the model on one device draws independent ones. :class:`StageRNG` keeps a
separate generator state per process, derived from the seed and the process's place in the job,
and :meth:`StageRNG.active` swaps it in (CPU, and the stage's CUDA device) only around the
stage's forward computations; the global state, which the data loader and the Trainer use and
which must stay identical on every pipeline rank of a replica, is untouched.

Recomputed layers draw the same masks in backward as in forward: ``torch.utils.checkpoint``
records the generator state that is current when the layer first runs (the stage's) and
restores it for the replay. The state is saved with each checkpoint (in the Trainer's RNG file
of the process) and restored on resume, so a resumed run draws what the uninterrupted one draws.

Cost per chunk forward: saving and restoring the CPU generator state (5 KB) and, on CUDA, the
device generator's seed and offset.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["StageRNG", "stream_seed"]

#: a large prime, so that streams of nearby seeds and ranks do not coincide
_STRIDE = 1_000_003


def stream_seed(seed: int, stream: int) -> int:
    """The generator seed of stream ``stream`` (a process's index in the job) for run seed ``seed``."""
    return (int(seed) * _STRIDE + int(stream) + 1) % (2**63 - 1)


class StageRNG:
    """A random stream of its own for one process (see the module docstring).

    ``seed``: the run's seed (``TrainingArguments.seed``); ``stream``: this process's index
    (global rank: every stage of every replica draws its own masks); ``device``: where the
    stage computes (its CUDA generator is swapped too).
    """

    def __init__(self, seed: int, stream: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.stream = int(seed), int(stream)
        self.device = torch.device(device)
        s = stream_seed(seed, stream)
        self._cpu = torch.Generator().manual_seed(s).get_state()
        self._cuda: torch.Tensor | None = None
        if self.device.type == "cuda":
            with torch.random.fork_rng(devices=[self.device]):
                torch.cuda.manual_seed(s)
                self._cuda = torch.cuda.get_rng_state(self.device)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stream inside the block; the global state is as it was afterwards."""
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state(self.device) if self._cuda is not None else None
        torch.set_rng_state(self._cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(self._cuda, self.device)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(cpu)
            if cuda is not None:
                self._cuda = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(cuda, self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "stream": self.stream, "cpu": self._cpu.clone(),
                "cuda": None if self._cuda is None else self._cuda.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["stream"]) != self.stream:
            raise ValueError(f"the saved random stream is process {state['stream']}'s, this is process {self.stream}: "
                             "resume with the checkpoint's number of processes and layout")
        self._cpu = state["cpu"].clone()
        if self._cuda is not None and state.get("cuda") is not None:
            self._cuda = state["cuda"].clone()
