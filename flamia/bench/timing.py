"""CUDA-event timing: warm-up, then the median of many repetitions, and peak memory."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200: 60 MB


@dataclass
class TimingSettings:
    warmup: int = 3          # untimed calls before measuring (compilation happens here)
    reps: int = 50           # most timed repetitions
    min_reps: int = 5        # fewest timed repetitions
    target_s: float = 1.0    # aim for about this much GPU time per measurement

    def to_dict(self) -> dict:
        return {"warmup": self.warmup, "reps": self.reps, "min_reps": self.min_reps,
                "target_s": self.target_s}


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    samples_ms: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "reps": self.reps}


def l2_bytes() -> int:
    try:
        import torch
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        n = int(getattr(props, "L2_cache_size", 0) or 0)
        return n if n > 0 else DEFAULT_L2_BYTES
    except Exception:
        return DEFAULT_L2_BYTES


def n_copies_for(working_set_bytes: int, l2: int | None = None, max_copies: int = 16) -> int:
    """How many copies of the inputs to rotate so that one rep does not find the previous rep's
    data in L2: 1 when a working set is larger than twice L2, else enough copies to span ~4x L2."""
    l2 = DEFAULT_L2_BYTES if l2 is None else l2
    if working_set_bytes <= 0 or working_set_bytes > 2 * l2:
        return 1
    return int(min(max_copies, max(2, math.ceil(4 * l2 / working_set_bytes))))


def cuda_time(fn: Callable[[int], object], n_copies: int, settings: TimingSettings,
              on_progress: Callable[[str], None] | None = None) -> Timing:
    """Median over CUDA events of fn(i), i rotating over n_copies input copies.

    fn is called `warmup` times untimed, then once more to estimate its duration, which sets the
    number of reps (between min_reps and reps, about target_s of GPU time in all). Each rep is
    bracketed by its own pair of events on the current stream.
    """
    import torch

    for i in range(settings.warmup):
        fn(i % n_copies)
    torch.cuda.synchronize()
    # estimate
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn(0)
    e.record()
    torch.cuda.synchronize()
    est_ms = max(s.elapsed_time(e), 1e-3)
    reps = int(min(settings.reps, max(settings.min_reps, settings.target_s * 1e3 / est_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for r in range(reps):
        starts[r].record()
        fn(r % n_copies)
        ends[r].record()
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) for a, b in zip(starts, ends)]
    return Timing(statistics.median(samples), min(samples), max(samples), reps, samples)


def peak_memory(fn: Callable[[], object]) -> int:
    """Bytes allocated at the peak of fn() above what was allocated before it (caching allocator
    statistics; reset_peak_memory_stats first)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
