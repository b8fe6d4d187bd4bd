"""Timing harness for the benchmarks: interleaved repetitions, medians, side-by-side ratios.

Every contender of a case is timed in the same process, round-robin: one call
of each per round, so drift (another process waking up, the CPU clocking down)
hits them all alike. The order is shuffled (with a fixed seed) every round, so
no contender always follows the same neighbour.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Self

import torch


@dataclass
class Contender:
    """One way of doing the case's work.

    Attributes:
      name: the row label.
      step: one timed call; it must leave the contender ready for the next call.
      note: shown beside the row (how it runs, what it assumes).
    """

    name: str
    step: Callable[[], object]
    note: str = ""


@dataclass
class Skipped:
    """A contender that could not run here, and why; shown as a row with no numbers."""

    name: str
    reason: str


@dataclass
class Timing:
    """The repetitions of one contender, in seconds."""

    name: str
    seconds: list[float]
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)


@dataclass
class CaseResult:
    """What one case measured: timings, rows that were skipped, ratios, memory, and notes."""

    key: str
    title: str
    unit: str = "ms"
    timings: list[Timing] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    ratios: list[tuple[str, str, str]] = field(default_factory=list)  # (label, numerator, denominator)
    memory: dict[str, list[float]] = field(default_factory=dict)  # name -> peak bytes per repetition
    memory_kind: str = ""
    notes: list[str] = field(default_factory=list)
    contention: float | None = None  # share of the CPUs other processes used while it was timed

    def timing(self, name: str) -> Timing | None:
        return next((t for t in self.timings if t.name == name), None)

    def ratio(self, numerator: str, denominator: str) -> float | None:
        """``median(numerator) / median(denominator)``, or ``None`` when either did not run."""
        a, b = self.timing(numerator), self.timing(denominator)
        if a is None or b is None:
            return None
        return a.median / b.median

    def paired_ratio(self, numerator: str, denominator: str) -> float | None:
        """The median over rounds of the per-round ratio; steadier than the ratio of medians under drift."""
        a, b = self.timing(numerator), self.timing(denominator)
        if a is None or b is None:
            return None
        return statistics.median(x / y for x, y in zip(a.seconds, b.seconds))


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``, or ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class Contention:
    """How much of the machine's CPU other processes used while a block ran (they share its cores).

    On a 2-core machine, a second process in a parallel region makes every
    OpenMP barrier wait for a time slice, so torch ops with many small
    parallel regions slow down many times over; this number says how much of
    that a run saw. ``None`` off Linux.
    """

    def __init__(self) -> None:
        self.fraction: float | None = None

    def __enter__(self) -> Self:
        self._start = (_cpu_jiffies(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        # Our own CPU time includes our threads; everything else the CPUs did was someone else's.
        (start, cpu0, wall0), end = self._start, _cpu_jiffies()
        if start is None or end is None:
            return
        ticks = os.sysconf("SC_CLK_TCK")
        ncpu = os.cpu_count() or 1
        others = (end[0] - start[0]) / ticks - (time.process_time() - cpu0)
        self.fraction = max(0.0, others / ((time.perf_counter() - wall0) * ncpu))


def measure(
    contenders: Sequence[Contender],
    *,
    reps: int,
    warmup: int,
    device: torch.device,
    log: Callable[[str], None] = print,
    wait_quiet: float = 0.0,
    settle: float = 0.05,
) -> tuple[list[Timing], float | None]:
    """Time every contender ``reps`` times, round-robin, after ``warmup`` untimed rounds.

    Args:
      contenders: what to time.
      reps: timed rounds.
      warmup: untimed rounds first (first-touch page faults, lazy state, caches).
      device: where the work runs; CUDA work is synchronized around each call.
      log: progress output.
      wait_quiet: after the warm-up, wait up to this many seconds for other
        processes to leave the CPUs (see :func:`wait_for_quiet`).
      settle: seconds to idle before each timed call, so the kernel's
        background work from the previous call (reclaiming freed memory) is
        not charged to the next one.

    Returns:
      One :class:`Timing` per contender, in the given order, and the share of
      the CPUs that other processes used during the timed rounds (see :class:`Contention`).
    """
    sync = synchronizer(device)
    for r in range(warmup):
        for c in contenders:
            c.step()
            sync()
        log(f"    warmup {r + 1}/{warmup} done")
    if wait_quiet > 0:
        wait_for_quiet(wait_quiet, log=log)
    seconds: dict[str, list[float]] = {c.name: [] for c in contenders}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing inside one contender's call would be charged to it alone
    try:
        with Contention() as contention:
            shuffler = random.Random(0)
            for _ in range(reps):
                # Every contender once per round, in a new order each round: a contender that
                # leaves work behind (freed gigabytes the kernel reclaims, caches it evicted)
                # then slows a different neighbour each time, not always the same one.
                order = list(contenders)
                shuffler.shuffle(order)
                for c in order:
                    time.sleep(settle)
                    sync()
                    t0 = time.perf_counter()
                    c.step()
                    sync()
                    seconds[c.name].append(time.perf_counter() - t0)
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return [Timing(c.name, seconds[c.name], c.note) for c in contenders], contention.fraction


def wait_for_quiet(
    max_seconds: float, *, threshold: float = 0.15, sample: float = 5.0, log: Callable[[str], None] = print
) -> float | None:
    """Wait (up to ``max_seconds``) until other processes use under ``threshold`` of the CPUs.

    Samples :class:`Contention` over ``sample`` seconds while this process idles.

    Args:
      max_seconds: the longest to wait; 0 measures once and returns.
      threshold: the share of the CPUs that counts as quiet.
      sample: seconds per measurement.
      log: progress output.

    Returns:
      The last measured share, or ``None`` off Linux.
    """
    deadline = time.perf_counter() + max_seconds
    while True:
        with Contention() as c:
            time.sleep(sample)
        if c.fraction is None or c.fraction < threshold or time.perf_counter() >= deadline:
            return c.fraction
        log(f"    other processes use {c.fraction:.0%} of the CPUs; waiting for a quieter moment ...")
