"""engine/clock.py: a round's seconds by step (RoundTimes) and whether a model captured.

The host clock is replaced by a scripted one, so each step's seconds are known exactly.
"""

from __future__ import annotations

import pytest
import torch

from verispec.engine import clock as round_clock
from verispec.engine.clock import RoundClock, step_capturers, timed
from verispec.engine.metrics import MetricsRecorder
from verispec.policy.scheduler import RoundTimes


class _Capturer:
    """A model that captures step graphs (models.base.CapturesSteps)."""

    def __init__(self) -> None:
        self.num_captured = 0


@pytest.fixture
def ticks(monkeypatch):
    """time.perf_counter, as the clock reads it, returning 0, 1, 3, 6, 10, ... (the gaps grow
    by one second a read, so every step has seconds of its own)."""
    reads = iter([sum(range(i + 1)) for i in range(100)])
    monkeypatch.setattr(round_clock.time, "perf_counter", lambda: float(next(reads)))


def test_each_step_gets_its_own_seconds(ticks):
    clock = RoundClock([])  # read 0: the round starts
    clock.drafted(torch.zeros(1, 2, dtype=torch.int64))  # read 1: the draft took 1 s
    clock.scored(torch.zeros(1, 3, 5))  # read 3: the target took 2 s
    times = clock.stop()  # read 6: verify, commit and emit took 3 s; the round 6 s
    assert times == RoundTimes(draft_time=1.0, target_time=2.0, verify_time=3.0, wall_time=6.0)
    assert times.other_time == 3.0  # outside drafting and the target's pass


def test_captured_counts_only_captures_since_the_start():
    model, other = _Capturer(), _Capturer()
    model.num_captured = 4  # captured before the round: not this round's cost
    capturers = step_capturers(model, None, object(), other)
    assert capturers == [model, other]
    clock = RoundClock(capturers)
    assert not clock.captured
    other.num_captured += 1
    assert clock.captured


def test_timed_runs_the_work_once(ticks):
    calls = []
    assert timed(torch.device("cpu"), lambda: calls.append(1)) == 1.0
    assert calls == [1]


def test_a_recorder_sums_the_rounds_times():
    recorder = MetricsRecorder()
    for times in (RoundTimes(1.0, 2.0, 3.0, 7.0), RoundTimes(0.5, 0.25, 0.125, 1.0)):
        recorder.record_round(1, 1, 0, 1, [1], [0], times)
    metrics = recorder.snapshot()
    assert (metrics.draft_time, metrics.target_time, metrics.verify_time, metrics.wall_time) == (
        1.5, 2.25, 3.125, 8.0)
