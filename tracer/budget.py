"""How long to keep probes attached each interval, and which functions to time, within a budget.

The tracer's cost lands on the traced threads: each hit of an entry-only probe costs `entry_ns`, each
timed call `entry_return_ns` (both calibrated, per function by the kind of its first instruction). Given the rates seen so far, the policy sizes the next
attach window so that the expected cost stays under `budget` x the target's CPU time per interval.

- The first window is a scout of `budget x interval`: even a process that did nothing but hit probes
  could not spend more than the budget in it.
- Hot functions (above `hot_hz`, not synchronizing) are counted with entry probes only; every
  `retime_every`-th window times everything, so their per-call time is still measured.
- When even `min_window_s` would cost too much, windows are spread out: one every k intervals.
- Windows start at a random offset in the interval, so a periodic workload is not sampled in phase.
- `every` > 1 (host-wide tracing, where one attach writes breakpoints into every process on the
  file): a window every that many intervals, as long as those intervals' budget pays for.
- Only functions seen called are probed, except in every `rescan_every`-th window, which probes all:
  each attach and detach rewrites the target's code pages once per probed function (a page
  replacement and a TLB flush in the target), so probing 682 functions to count the 11 a training
  loop calls would cost the target more than the probes that fire.
- A young process is rescanned more often: in its windows 1, 2, 4, 8 and 16 (`YOUNG_RESCANS`), as
  well as its first. A job found while it starts up (PyTorch maps libcuda at its first CUDA call,
  then loads and sets up for seconds) calls other functions then than in its steady loop; with
  rescans only every `rescan_every`-th window its loop's calls would go uncounted for that long
  (a minute, host-wide). Doubling finds a change of phase at window k by window 2k, for 5 extra
  rescans over a process's life.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Mapping

from .calibrate import ProbeCost
from .classify import FunctionClass


# A process's windows (counted from 0, its first, which always probes everything) that probe every
# function again: see the module's docstring.
YOUNG_RESCANS = frozenset({1, 2, 4, 8, 16})


@dataclass(frozen=True)
class Plan:
    attach: bool
    offset_s: float
    window_s: float
    timed: frozenset[int]
    probe: frozenset[int]  # functions to attach in this window


class Policy:
    def __init__(
        self,
        classes: Mapping[int, FunctionClass],
        costs: Mapping[int, ProbeCost],
        *,
        budget: float,
        interval_s: float,
        min_window_s: float = 0.002,
        hot_hz: float = 5000.0,
        retime_every: int = 4,
        rescan_every: int = 10,
        max_growth: float | None = 2.0,
        max_skip: int = 30,
        every: int = 1,
        rng: random.Random | None = None,
    ) -> None:
        self.classes = dict(classes)
        self.costs = dict(costs)
        self.budget = budget
        self.interval_s = interval_s
        self.min_window_s = min(min_window_s, interval_s)
        self.hot_hz = hot_hz
        self.retime_every = retime_every
        self.rescan_every = rescan_every
        self.max_growth = max_growth
        self.max_skip = max_skip
        self.seen: set[int] = set()
        self.reserved_s_per_s = 0.0  # probe time/s of the always-attached marker
        self.last_window_s = 0.0
        self.measured_loss: float | None = None  # share of the target's progress a window costs, measured
        self.rng = rng or random.Random()
        self.exact = budget >= 1.0
        self.rates: dict[int, float] = {}
        self.cpu_s_per_s: float | None = None
        self.windows = 0
        self.skip = 0
        self.rescan_next = False  # probe every function in the next window (rescan_soon)
        # A window every `every` intervals, `every` times as long (the same budget over those
        # intervals): each window's attach and detach costs the same whatever its length.
        self.every = max(1, every)
        self._ticks = 0

    def _timed(self) -> frozenset[int]:
        if self.exact or self.windows % self.retime_every == 0:
            return frozenset(self.classes)
        return frozenset(
            f for f in self.classes
            if self.rates.get(f, 0.0) < self.hot_hz or self.classes[f] is FunctionClass.SYNC
        )

    def choose_marker(self, cpu_s_per_s: float | None) -> int | None:
        """The most-called function whose probe, attached all the time, costs at most a quarter of the
        budget (more counts, a tighter ratio), if it is called at least 20/s; None if there is none.
        An unmeasured or zero CPU time (a first interval shorter than a clock tick) chooses nothing yet:
        taking it for a whole CPU would let the marker alone cost a light job a quarter of its time."""
        if not cpu_s_per_s:
            return None
        ok = [(r, f) for f, r in self.rates.items()
              if f in self.seen and r >= 20.0 and self.marker_cost(f, r) <= self.budget * cpu_s_per_s / 4]
        if not ok:
            return None
        r, f = max(ok)
        self.reserved_s_per_s = r * self.costs[f].entry_ns * 1e-9
        return f

    def marker_cost(self, f: int, rate_hz: float | None = None) -> float:
        """Probe seconds per second of keeping function f's entry probed all the time."""
        r = self.rates.get(f, 0.0) if rate_hz is None else rate_hz
        return r * self.costs[f].entry_ns * 1e-9

    def rescan_soon(self) -> None:
        """The next window probes every function (a process joined whose calls are not seen yet)."""
        self.rescan_next = True

    def _young(self) -> bool:
        """The next window is one of a young process's extra rescans."""
        return self.windows in YOUNG_RESCANS

    def _probe(self) -> frozenset[int]:
        # Nothing seen yet (a window before the job's first driver call): keep looking everywhere.
        if self.exact or not self.seen or self.windows % self.rescan_every == 0 or self.rescan_next \
                or self._young():
            self.rescan_next = False
            return frozenset(self.classes)
        return frozenset(self.seen)

    def cost_per_s(self, timed: frozenset[int]) -> float:
        """Expected probe seconds per attached second, at the rates seen so far."""
        return sum(r * self.costs[f].cost_ns(f in timed) * 1e-9 for f, r in self.rates.items() if f in self.costs)

    def affordable_s(self, timed: frozenset[int]) -> float:
        """The window this process's budget pays for in one interval, with `timed` functions timed."""
        if self.windows == 0:
            return max(self.min_window_s, self.budget * self.interval_s)
        cpu = self.cpu_s_per_s if self.cpu_s_per_s is not None else 1.0
        allowed = max(0.0, self.budget * cpu - self.reserved_s_per_s) * self.interval_s
        # Probes cannot take more of an attached second than the target's threads have: a dense
        # caller is slowed until its probe time saturates its CPU, not beyond.
        model = self.cost_per_s(timed)
        if self.measured_loss is not None:
            # The marker measured what a window really costs the target (cache and TLB misses
            # included, which the calibration loop does not see): budget by the larger.
            model = max(model, self.measured_loss * cpu)
        cost = min(model, max(cpu, 1e-3))
        return self.interval_s if cost <= 0 else allowed / cost

    def plan(self) -> Plan:
        if self.every > 1 and not self.exact:
            self._ticks += 1
            if (self._ticks - 1) % self.every:  # the first interval has its window
                return Plan(False, 0.0, 0.0, frozenset(), frozenset())
        timed = self._timed()
        probe = self._probe()
        if self.exact:
            return Plan(True, 0.0, self.interval_s, timed, probe)
        if self.skip > 0:
            self.skip -= 1
            return Plan(False, 0.0, 0.0, timed, probe)
        window = self.affordable_s(timed) * self.every
        if window < self.min_window_s:
            # Never for good: a CPU time measured as zero (a light job between two clock ticks)
            # affords no window at all, and would otherwise stop the sampling for ever.
            self.skip = min(self.max_skip, max(0, math.ceil(self.min_window_s / max(window, 1e-9)) - 1))
            window = self.min_window_s
        # Grow at most 2x an interval: a job that goes from idle (long windows are cheap) to busy
        # would otherwise pay a whole long window at the new rate before the policy sees it.
        if self.last_window_s and self.max_growth:
            window = min(window, self.max_growth * self.last_window_s)
        window = min(window, self.interval_s)
        self.last_window_s = window
        offset = self.rng.uniform(0.0, self.interval_s - window)
        return Plan(True, offset, window, timed, probe)

    def observe(self, window_s: float, calls: Mapping[int, int], cpu_s_per_s: float | None) -> None:
        if cpu_s_per_s is not None:
            self.cpu_s_per_s = cpu_s_per_s
        if window_s <= 0:
            return
        first = self.windows == 0
        self.windows += 1
        self.seen.update(f for f, n in calls.items() if n)
        for f in set(self.rates) | set(calls):
            seen = calls.get(f, 0) / window_s
            self.rates[f] = seen if first or f not in self.rates else 0.5 * (self.rates[f] + seen)


class AlignedPolicy(Policy):
    """One window for every process on one set of links (tracer/host.py): each process keeps its own
    Policy (`members`, by pid), which says what its budget affords; the window is the least of those,
    so no process pays more than its own budget. Which functions are probed and timed follows all of
    them: a function seen in any process is probed, one hot in any process is only counted."""

    def __init__(self, classes: Mapping[int, FunctionClass], costs: Mapping[int, ProbeCost], **kw) -> None:
        super().__init__(classes, costs, **kw)
        self.members: dict[int, Policy] = {}

    def affordable_s(self, timed: frozenset[int]) -> float:
        if not self.members:
            return self.interval_s  # no one to charge: the links cost nothing
        return min(p.affordable_s(timed) for p in self.members.values())

    def choose_marker(self, cpu_s_per_s: float | None = None) -> int | None:
        """One marker for all members, on links without a pid filter: the function called most over
        all of them whose probe costs each member at most a quarter of its budget; None while a
        member's CPU time is unmeasured or nothing qualifies. Each member reserves its own share."""
        members = list(self.members.values())
        if not members or not all(p.cpu_s_per_s for p in members):
            return None
        called = {f for p in members for f, r in p.rates.items() if f in p.seen and r >= 20.0}
        ok = [(sum(p.rates.get(f, 0.0) for p in members), f) for f in called
              if all(p.marker_cost(f) <= p.budget * p.cpu_s_per_s / 4 for p in members)]
        if not ok:
            return None
        _, f = max(ok)
        for p in members:
            p.reserved_s_per_s = p.marker_cost(f)
        return f

    def _young(self) -> bool:
        # By each member's own age: the aligned count is the session's, which may be long.
        return any(p.windows in YOUNG_RESCANS for p in self.members.values())

    def marker_too_dear(self, f: int) -> bool:
        """A member got lighter, or its calls of `f` denser: the shared marker costs it over half its budget."""
        return any(p.cpu_s_per_s and p.marker_cost(f) > p.budget * p.cpu_s_per_s / 2 for p in self.members.values())

    def merge(self, window_s: float) -> None:
        """After the members observed a window of `window_s`: the union of what they saw."""
        if window_s > 0:
            self.windows += 1
        self.seen = set().union(*(p.seen for p in self.members.values()))
        rates: dict[int, float] = {}
        for p in self.members.values():
            for f, r in p.rates.items():
                rates[f] = max(r, rates.get(f, 0.0))
        self.rates = rates
