"""Renderers, chosen by kind and name from one registry: text for people, JSON for scripts.

Kind "attach" renders an `attach` session (each interval as it ends, then the report); kind
"frame" renders one host frame (`top --once`). JSON goes through orjson; its layouts are versioned
(SCHEMA here, hostview.model.SCHEMA for frames) and documented in docs/json-schema.md.
"""

from __future__ import annotations

import dataclasses
from typing import IO, Callable, Protocol

import orjson

from .base.units import fmt_ns, fmt_pct, fmt_rate, fmt_rate_or, fmt_s_per_s
from .tracer.audit import Audit
from .tracer.calibrate import Calibration
from .tracer.classify import waits
from .tracer.model import Interval, ProcessSnapshot

SCHEMA = 2  # 2: budget and tracer_overhead are shares of the job's time; not_measured, exposure, windows


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything a finished `attach` session has to say."""

    pid: int
    comm: str
    library: str
    command: tuple[str, ...]
    exit_status: int | None
    options: dict
    calibration: Calibration
    attach: dict
    summary: ProcessSnapshot
    audits: tuple[Audit, ...]
    intervals: tuple[Interval, ...]
    errors: dict[str, int]


class Renderer(Protocol):
    """Kind "attach": `interval` as each ends, `final` with the Report. Kind "frame": `final` with a
    HostSnapshot (`interval` is never called)."""

    def interval(self, iv: Interval, out: IO[str]) -> None: ...
    def final(self, report, out: IO[str]) -> None: ...


RENDERERS: dict[tuple[str, str], Callable[..., Renderer]] = {}


def renderer(name: str, kind: str = "attach") -> Callable:
    def register(cls: Callable[..., Renderer]) -> Callable[..., Renderer]:
        RENDERERS[(kind, name)] = cls
        return cls

    return register


# --- text ---------------------------------------------------------------------------------------
@renderer("text")
class TextRenderer:
    top_functions = 25

    def interval(self, iv: Interval, out: IO[str]) -> None:
        for p in iv.processes:
            # A share of the interval: at most all of it (the window's span is stamped a little
            # apart from the interval's, and read 100.1% under --exact).
            share = min(1.0, iv.window_s / iv.interval_s) if iv.interval_s else 0.0
            if p.not_measured is not None:
                out.write(f"[{iv.t_start:7.1f}s] pid {p.pid} {p.comm}: not measured ({p.not_measured})\n")
                continue
            over = (p.driver_cpu_s_per_s or 0) > 1.0 or (p.wait_s_per_s or 0) > 1.0
            out.write(
                f"[{iv.t_start:7.1f}s] pid {p.pid} {p.comm}: {fmt_rate_or(p.calls_hz, p.calls_not_known)} calls/s  "
                f"driver CPU {fmt_pct(p.driver_cpu_s_per_s, 1)}  wait {fmt_pct(p.wait_s_per_s, 1)}"
                f"{' (summed over threads)' if over else ''}  "
                f"probed {fmt_pct(share, 1)} of the interval  tracer {fmt_pct(p.tracer_overhead)} of its time\n"
            )
        out.flush()

    def final(self, r: Report, out: IO[str]) -> None:
        s = r.summary
        w = out.write
        cmd = f" `{' '.join(r.command)}`" if r.command else ""
        w(f"gputrace audit of pid {r.pid} ({r.comm}){cmd}\n")
        w(f"  libcuda            {r.library}\n")
        mode = "every call (exact)" if r.options["exact"] else f"sampled windows, budget {fmt_pct(r.options['budget'], 1)} of its time"
        w(f"  traced             {s.interval_s:.1f} s; probes attached {fmt_pct(min(1.0, s.window_s / s.interval_s) if s.interval_s else 0, 1)} of it ({mode})\n")
        for kind in ("emulated", "stepped"):
            c = r.calibration.of(kind)
            w(f"  probe cost         {fmt_ns(c.entry_ns)} a counted call, {fmt_ns(c.entry_return_ns)} a timed call, "
              f"{fmt_ns(c.bias_ns)} subtracted from each timed call ({kind} first instruction)\n")
        cpu = f", {fmt_pct(s.tracer_cpu_share)} of its {s.target_cpu_s:.2f} CPU-s" if s.target_cpu_s else ""
        expo = (f"the job lost {s.exposure:.2f}x the probes' calibrated time, as measured" if s.exposure is not None
                else "the probes' calibrated time taken at 2x, as on the H200: not measured in this job")
        w(f"  tracer's own cost  {fmt_pct(s.tracer_overhead)} of the job's time: {fmt_ns(s.tracer_cost_s * 1e9)}{cpu} "
          f"({expo})\n")
        if r.exit_status is not None:
            w(f"  command exited     with status {r.exit_status}\n")
        w("\n")
        if s.not_measured is not None:
            w(f"  not measured: {s.not_measured}\n")
            out.flush()
            return
        if s.calls_not_known:
            w(f"  driver calls       not known ({s.calls_not_known})\n")
        else:
            w(f"  driver calls       {fmt_rate(s.calls_hz)}/s\n")
        w(f"  driver CPU time    {fmt_s_per_s(s.driver_cpu_s_per_s)} in calls that do not wait for the GPU\n")
        w(f"  wait time          {fmt_s_per_s(s.wait_s_per_s)} in calls that wait for it (synchronization, "
          f"synchronous copies)\n")
        if (s.driver_cpu_s_per_s or 0) > 1.0 or (s.wait_s_per_s or 0) > 1.0:
            w("                     (above 100%: summed over the threads that make driver calls)\n")
        if s.wait_s_per_s is None and s.driver_cpu_s_per_s is not None and not any(
                waits(f.name) for f in s.functions):
            w("                     (no call that waits was traced: --functions left them out)\n")
        w("\n")
        w(f"  {'class':<16}{'calls/s':>12}{'time/s':>14}\n")
        for t in s.classes:
            w(f"  {t.cls.value:<16}{fmt_rate_or(t.rate_hz, t.not_known):>12}{fmt_ns(t.time_s_per_s * 1e9):>14}\n")
        w("\n")
        shown = s.functions[: self.top_functions]
        nw = max([len("function")] + [len(f.name) for f in shown]) + 2
        w(f"  {'function':<{nw}}{'class':<17}{'calls/s':>10}{'±95%':>9}{'mean':>11}{'p99 <':>11}\n")
        for f in shown:
            err = ("" if f.not_known else "?" if f.rate_err_hz is None
                   else f"{100 * f.rate_err_hz / f.rate_hz:.1f}%" if f.rate_hz else "-")
            w(f"  {f.name:<{nw}}{f.cls.value:<17}{fmt_rate_or(f.rate_hz, f.not_known):>10}{err:>9}{fmt_ns(f.mean_ns):>11}"
              f"{fmt_ns(f.p99_ns):>11}\n")
        unknown = [f for f in shown if f.not_known]
        if unknown:
            w("  not known: " + "; ".join(f"{f.name} ({f.not_known})" for f in unknown) + "\n")
        if len(s.functions) > self.top_functions:
            w(f"  ... and {len(s.functions) - self.top_functions} more (all of them with --json)\n")
        w("\n  what an interception layer would cost this job (its cost a call, and up to 1.5x that on the\n"
          "  job's own code when nothing hides it, as measured on the H200: bench/results/audit-gpu-h200.md):\n")
        for a in r.audits:
            what = (f"the {a.preset_functions} functions the shim gates ({', '.join(a.classes)})" if a.preset == "shim"
                    and a.preset_functions is not None else ', '.join(a.classes))
            w(f"  - {a.preset}: intercepts {what} at {fmt_ns(a.cost_ns)} a call ({a.cost_source})\n")
            if a.preset_functions is not None:
                shown_fns = ", ".join(a.functions[:6]) + (f", ... ({len(a.functions)} in all)" if len(a.functions) > 6 else "")
                w(f"      counted on {shown_fns or 'none of them: the job called none'}\n")
            if a.not_known:
                w(f"      intercepted rate not known ({a.not_known})\n"
                  f"      predicted slowdown between {fmt_pct(a.slowdown_lower)} (hidden in the wait) and "
                  f"{fmt_pct(a.slowdown_upper)} (fully exposed), over that interval\n")
                continue
            w(f"      {fmt_rate(a.intercepted_hz)} calls/s intercepted -> {fmt_ns(a.added_cpu_s_per_s * 1e9)} CPU per second\n")
            hidden = "hidden in the calling threads' slack" if a.lower_basis == "threads" else "hidden in the wait"
            low = "not known (no calling thread's slack was measured)" if a.slowdown_lower is None and \
                a.lower_basis == "threads" else fmt_pct(a.slowdown_lower)
            w(f"      predicted slowdown between {low} ({hidden}) "
              f"and {fmt_pct(a.slowdown_upper)} (fully exposed)\n")
            for t in sorted(a.threads or (), key=lambda t: -t.added_s_per_s)[:4]:
                if t.added_s_per_s <= 0:
                    continue
                slack = ("slack not measured" if t.headroom_s_per_s is None else
                         f"slack {fmt_pct(t.headroom_s_per_s)} (off a CPU {fmt_pct(t.off_s_per_s)}, waiting for the GPU "
                         f"{fmt_pct(t.wait_s_per_s)}) -> at least {fmt_pct(t.exposed)}")
                w(f"        thread {t.tid} ({t.comm}): {100 * t.intercepted_share:.0f}% of the calls, "
                  f"+{fmt_pct(t.added_s_per_s)} of its time; {slack}\n")
            if a.lower_basis == "threads" and a.pacer:
                w(f"        busiest thread: {a.pacer['tid']} ({a.pacer['comm']}), on a CPU or waiting for one "
                  f"{fmt_pct(a.pacer['busy_s_per_s'])} of the time\n")
            if a.intercepted_err_hz:
                w(f"      with the rates' 95% intervals (±{fmt_rate(a.intercepted_err_hz)} calls/s): "
                  f"{fmt_pct(a.slowdown_lower_min)} to {fmt_pct(a.slowdown_upper_max)}\n")
            elif a.intercepted_err_hz is None and a.intercepted_hz:
                w("      the intercepted rate's interval is not known: the bounds are at the rates as read\n")
        # Unpaired returns and stale frames are expected at every window's edges; these are not.
        bad = {k: v for k, v in r.errors.items() if v and k in ("stats_full", "threads_full", "depth")}
        if bad:
            w("\n  tracer notes: " + ", ".join(f"{k} {v}" for k, v in bad.items()) + "\n")
        out.flush()


# --- JSON ---------------------------------------------------------------------------------------
def report_dict(r: Report, with_intervals: bool = True) -> dict:
    return {
        "schema": SCHEMA,
        "kind": "gputrace.attach",
        "pid": r.pid,
        "comm": r.comm,
        "library": r.library,
        "command": list(r.command),
        "exit_status": r.exit_status,
        "options": r.options,
        "calibration": dataclasses.asdict(r.calibration),
        "attach": r.attach,
        "summary": r.summary.to_dict(),
        "audits": [a.to_dict() for a in r.audits],
        "errors": r.errors,
        "intervals": [
            {**dataclasses.asdict(iv), "processes": [p.to_dict() for p in iv.processes]}
            for iv in r.intervals
        ] if with_intervals else [],
    }


def dumps(obj: object) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


@renderer("json")
class JsonRenderer:
    def interval(self, iv: Interval, out: IO[str]) -> None:
        pass  # the document comes once, at the end

    def final(self, r: Report, out: IO[str]) -> None:
        out.write(dumps(report_dict(r)).decode() + "\n")
        out.flush()


@renderer("jsonl")
class JsonLinesRenderer:
    """A compact line per interval as it ends (every process's snapshot), then the report without
    its intervals: for `jq`, log shippers and scripts that follow a long attach."""

    def interval(self, iv: Interval, out: IO[str]) -> None:
        d = {"schema": SCHEMA, "kind": "gputrace.attach.interval", **dataclasses.asdict(iv),
             "processes": [p.to_dict() for p in iv.processes]}
        out.write(orjson.dumps(d, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
        out.flush()

    def final(self, r: Report, out: IO[str]) -> None:
        out.write(orjson.dumps(report_dict(r, with_intervals=False),
                               option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
        out.flush()


# --- a job (`attach --tree PID`, `attach -p A,B`) -------------------------------------------------
@renderer("text", kind="job")
class JobTextRenderer:
    top_functions = 15

    def interval(self, iv: Interval, out: IO[str]) -> None:
        pass

    def final(self, r, out: IO[str]) -> None:
        from .tui.text import fmt_share, fmt_thread_share, overhead_bounds

        w = out.write
        cmd = f" `{' '.join(r.command)}`" if r.command else ""
        sel = f" ({r.selection})" if r.selection != r.key else ""
        of = f" of the {r.world} its launcher says there are" if r.world is not None and r.world != len(r.ranks) else ""
        what = f"job {r.key}{sel}" if r.key != r.selection else r.selection
        w(f"gputrace audit of {what}{cmd}: {len(r.ranks)} process(es){of}, traced {r.traced_s:.1f} s\n")
        libs = sorted({k.library for k in r.ranks})
        if len(libs) == 1:
            w(f"  libcuda            {libs[0]}\n")
        mode = ("every call (exact)" if r.options["exact"]
                else f"sampled windows, budget {fmt_pct(r.options['budget'], 1)} of each process's time")
        w(f"  traced             {mode}; each process from when it was found\n")
        if r.calibration is not None:
            c = r.calibration.of("emulated")
            w(f"  probe cost         {fmt_ns(c.entry_ns)} a counted call, {fmt_ns(c.entry_return_ns)} a timed call\n")
        if r.exit_status is not None:
            w(f"  command exited     with status {r.exit_status}\n")
        w("\n")
        if not r.ranks:
            w("  no process of the job mapped a libcuda while it was traced\n")
        else:
            heads = ["rank", "pid", "comm", "calls/s", "driver CPU", "wait", "tracer", *(p.name for p, _ in r.jobs)]
            table = []
            for k in r.ranks:
                s = k.summary
                row = ["-" if k.rank is None else str(k.rank), str(k.pid), k.comm + (" (exited)" if k.exited else "")]
                if s.not_measured is not None:
                    row += [f"not measured: {s.not_measured}"]
                else:
                    row += [fmt_rate(s.calls_hz), fmt_thread_share(s.driver_cpu_s_per_s),
                            fmt_thread_share(s.wait_s_per_s), fmt_share(s.tracer_overhead),
                            *(overhead_bounds(a.slowdown_lower, a.slowdown_upper) for a in k.audits)]
                table.append(row)
            j0 = r.jobs[0][1]
            table.append(["job", "", f"{len(r.ranks)} processes", fmt_rate(j0.calls_hz), "", "", "",
                          *(overhead_bounds(j.slowdown_lower, j.slowdown_upper) for _, j in r.jobs)])
            widths = [max(len(x[i]) for x in [heads, *table] if len(x) > i and len(x) == len(heads))
                      for i in range(len(heads))]
            for row in [heads, *table]:
                if len(row) < len(heads):  # a rank not measured: its reason, not a row of dashes
                    w("  " + "  ".join(c.rjust(widths[i]) if i < 2 else c.ljust(widths[i]) for i, c in enumerate(row[:3]))
                      + "  " + row[3] + "\n")
                    continue
                w("  " + "  ".join(c.ljust(wd) if i == 2 else c.rjust(wd) for i, (c, wd) in enumerate(zip(row, widths))).rstrip() + "\n")
            w("\n  what an interception layer would cost the job: a data-parallel step ends in a collective that\n"
              "  waits for every rank, so the job moves at its slowest rank's pace; it slows by at least the\n"
              "  largest of its ranks' lower bounds and at most the largest of their upper bounds:\n")
            for p, j in r.jobs:
                slowest = f" (its slowest rank: pid {j.slowest})" if j.slowest is not None else ""
                if j.slowdown_upper is None and j.slowdown_lower is None:
                    verdict = "not known: a process was not measured"
                elif j.slowdown_upper is None:  # another rank's lower bound holds for the job
                    verdict = f"at least {fmt_pct(j.slowdown_lower)} (the upper bound is not known: a process was not measured)"
                elif j.slowdown_lower is None:
                    verdict = (f"at most {fmt_pct(j.slowdown_upper)} (no rank's lower bound is known: a wait or a "
                               f"calling thread's slack was not measured){slowest}")
                else:
                    verdict = f"between {fmt_pct(j.slowdown_lower)} and {fmt_pct(j.slowdown_upper)}{slowest}"
                w(f"  - {p.name}: intercepts {', '.join(sorted(c.value for c in p.classes))} at {fmt_ns(p.cost_ns)} "
                  f"a call: {verdict}\n")
            from .hostview.jobaudit import function_totals

            totals = function_totals(r.ranks)
            if totals:
                shown = totals[: self.top_functions]
                nw = max([len("function")] + [len(t.name) for t in shown]) + 2
                w(f"\n  {'function':<{nw}}{'class':<17}{'calls/s':>10}{'ranks':>7}{'mean':>11}   (all processes)\n")
                for t in shown:
                    w(f"  {t.name:<{nw}}{t.cls:<17}{fmt_rate_or(t.rate_hz, t.not_known):>10}{t.ranks:>7}{fmt_ns(t.mean_ns):>11}\n")
                if len(totals) > self.top_functions:
                    w(f"  ... and {len(totals) - self.top_functions} more (each process's with --json)\n")
        for n in r.notes:
            w(f"  note: {n}\n")
        out.flush()


@renderer("json", kind="job")
class JobJsonRenderer:
    def interval(self, iv: Interval, out: IO[str]) -> None:
        pass

    def final(self, r, out: IO[str]) -> None:
        from .hostview.jobaudit import report_dict as job_report_dict

        out.write(dumps(job_report_dict(r, SCHEMA)).decode() + "\n")
        out.flush()


# --- a host frame (`top --once`) ------------------------------------------------------------------
@renderer("text", kind="frame")
class FrameTextRenderer:
    def __init__(self, preset: str) -> None:
        self.preset = preset

    def interval(self, iv: Interval, out: IO[str]) -> None:
        pass

    def final(self, frame, out: IO[str]) -> None:
        from .tui.text import render_host  # the dashboard's own table, as text

        out.write(render_host(frame, self.preset))
        out.flush()


@renderer("json", kind="frame")
class FrameJsonRenderer:
    def __init__(self, preset: str) -> None:
        pass  # every preset's audit is in the frame

    def interval(self, iv: Interval, out: IO[str]) -> None:
        pass

    def final(self, frame, out: IO[str]) -> None:
        from .hostview.model import host_dict

        out.write(dumps(host_dict(frame)).decode() + "\n")
        out.flush()


def get(name: str, kind: str = "attach", **options) -> Renderer:
    return RENDERERS[(kind, name)](**options)

