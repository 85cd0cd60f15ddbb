"""``ThreadTuner``: picks the CPU thread count of the model's kernels by measuring it (``num_threads="auto"``).

Every kernel of a CPU step is an OpenMP parallel region whose threads spin at its end until all of them
are done. On a machine whose cores are also busy with other jobs, one of those threads is regularly
descheduled and the others spin for a whole scheduler time slice, over and over: on a 2-core machine
running two other busy processes, a decode step with 2 threads took 13x as long as with 1 (2.0 vs 27
tokens/s); on an idle machine 2 threads stream weights 1.6x faster than 1. No fixed setting suits both, and
the load changes, so the tuner measures:

- decode steps are keyed by their batch size (rounded up to a power of two); every ``period`` steps of a key
  it *probes*: ``probe_steps`` steps with each candidate thread count in turn (all cores, then 1), timed
  back to back so that both see the same load, and keeps the candidate with the lower mean step time (the
  mean, not the median: under contention the slow steps are the cost);
- a probe whose loser was more than ``BACKOFF_RATIO`` times slower doubles that key's period (up to
  ``MAX_BACKOFF`` times the base; a close call resets it), so a clear verdict is not paid for every period;
- other steps (prefill chunks, rare and each of its own size) run with the latest verdict of any key.

Thread counts change only between steps (``torch.set_num_threads``; process-wide, like torch's own setting).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

BACKOFF_RATIO = 1.5
MAX_BACKOFF = 16


@dataclass
class _KeyState:
    period: int  # steps from one probe to the next
    steps: int = 0  # steps run since the last probe began
    choice: int = 0  # thread count to use outside probes
    samples: dict[int, list[float]] = field(default_factory=dict)  # this probe's step times per candidate


class ThreadTuner:
    @classmethod
    def for_engine(cls, num_threads: int | str | None, device: torch.device, world_size: int) -> ThreadTuner | None:
        """The engine's setting of ``num_threads``: ``"auto"`` gives a tuner (one CPU rank only), an integer
        sets torch's thread count now (process-wide, as torch's own setting is), None leaves torch's."""
        if num_threads is None or device.type != "cpu" or world_size > 1:
            return None
        if num_threads == "auto":
            return cls(len(os.sched_getaffinity(0)))
        torch.set_num_threads(int(num_threads))
        return None

    def __init__(self, max_threads: int, period: int = 96, probe_steps: int = 4) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.candidates = [max_threads] + ([1] if max_threads > 1 else [])
        self.period = max(period, probe_steps * len(self.candidates))
        self.probe_steps = probe_steps
        self.states: dict[int, _KeyState] = {}
        self.current = max_threads  # the latest verdict

    @staticmethod
    def key(num_tokens: int) -> int:
        return 1 << max(num_tokens - 1, 0).bit_length()

    def threads_for(self, state: _KeyState) -> int:
        probe_len = self.probe_steps * len(self.candidates)
        if state.steps < probe_len:  # probing: each candidate for probe_steps steps, in turn
            return self.candidates[state.steps // self.probe_steps]
        return state.choice

    @contextmanager
    def step(self, num_tokens: int, decode: bool = True) -> Iterator[int]:
        """Run one step of ``num_tokens`` tokens inside: sets the thread count (and times decode steps)."""
        state = None
        if decode:
            state = self.states.setdefault(self.key(num_tokens), _KeyState(self.period, choice=self.current))
        threads = self.threads_for(state) if state is not None else self.current
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        yield threads
        if state is not None:
            self._record(state, threads, time.perf_counter() - t0)

    def _record(self, state: _KeyState, threads: int, elapsed: float) -> None:
        probe_len = self.probe_steps * len(self.candidates)
        if state.steps < probe_len:
            state.samples.setdefault(threads, []).append(elapsed)
            if state.steps == probe_len - 1:
                means = {t: statistics.fmean(v) for t, v in state.samples.items()}
                state.choice = self.current = min(means, key=means.__getitem__)
                clear = max(means.values()) > BACKOFF_RATIO * min(means.values())
                state.period = min(state.period * 2, self.period * MAX_BACKOFF) if clear else self.period
                state.samples = {}
        state.steps = (state.steps + 1) % state.period
