"""A round's clock: the seconds each step of a batch's round took, and whether it captured.

What it is: the timing of :meth:`verispec.engine.batch.Batch.step` (policy.scheduler.RoundTimes),
with the device synchronisations that make a step's seconds its own (an accelerator runs ahead
of the host: without a sync a step's kernels are paid for in the next step's clock), and the
count of CUDA graphs the models captured during the round. What it is not: a decision. The
scheduler (policy/scheduler.py) prices rounds from what the clock reports, and nothing here
changes any token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..models.base import CapturesSteps
from ..policy.scheduler import RoundTimes


def step_capturers(*models: object) -> list[CapturesSteps]:
    """The models (or proposers, None skipped) that capture steps as CUDA graphs. A round in
    which one captured reaches the policy as a first use: a capture costs tens of steps, and a
    new cache layout or key bucket brings one long after a depth's first round; taken at full
    weight, such rounds priced drafting out of reach."""
    return [model for model in models if isinstance(model, CapturesSteps)]


class RoundClock:
    """Started as a round's step 1 starts; :meth:`drafted` and :meth:`scored` close steps 1
    and 2 on the tensors they produced, :meth:`stop` the round.

    Example: ``clock = RoundClock(capturers)``; propose; ``clock.drafted(draft_tokens)``;
    score; ``clock.scored(target_logits)``; verify, commit, emit; ``times = clock.stop()``,
    then ``clock.captured``.
    """

    def __init__(self, capturers: Sequence[CapturesSteps]) -> None:
        self._capturers = capturers
        self._captures = _num_captured(capturers)  # before the round
        self._started = self._step_started = time.perf_counter()
        self._draft_time = self._target_time = 0.0

    def drafted(self, draft_tokens: torch.Tensor) -> None:
        """Step 1 ended with ``draft_tokens`` [B, K]."""
        self._draft_time = self._lap(draft_tokens)

    def scored(self, target_logits: torch.Tensor) -> None:
        """Step 2 ended with ``target_logits`` [B, K+1, V]."""
        self._target_time = self._lap(target_logits)

    def stop(self) -> RoundTimes:
        """The round ended: its seconds by step (verification, commit and emit in
        verify_time, read without a sync: their results are host values)."""
        now = time.perf_counter()
        return RoundTimes(self._draft_time, self._target_time, now - self._step_started,
                          now - self._started)

    @property
    def captured(self) -> bool:
        """Whether a model captured a step graph since the clock started."""
        return _num_captured(self._capturers) > self._captures

    def _lap(self, tensor: torch.Tensor) -> float:
        """Seconds since the step started, once the device that produced ``tensor`` finished;
        the next step starts now."""
        synchronize(tensor.device)
        now = time.perf_counter()
        seconds, self._step_started = now - self._step_started, now
        return seconds


def timed(device: torch.device, work: Callable[[], object]) -> float:
    """Run ``work`` and return its seconds, once ``device`` finished it (a draft's prefill or
    catch-up, which the scheduler prices apart from the rounds)."""
    started = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _num_captured(capturers: Sequence[CapturesSteps]) -> int:
    return sum(model.num_captured for model in capturers)
