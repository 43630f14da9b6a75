"""Reading jax.profiler traces (shared by the benchmarks): the device's kernels and their times.

A trace is the directory given to `jax.profiler.start_trace(dir)` (then `stop_trace()`); the
newest `*.xplane.pb` below it is read with `jax.profiler.ProfileData`. On a GPU the kernels are
the events of the "/device:GPU..." planes' lines whose name contains "Stream" (the defaults).
Other backends keep their ops elsewhere: on CPU the XLA ops are events of the "/host:CPU"
plane, on the line of the PjRt client's thread ("tf_XLAPjRtCpuClient/<id>"), next to
zero-length "ThreadpoolListener::..." and "end: <op>" markers.
"""
from __future__ import annotations

import collections
import glob
import os

NAME_LEN = 60  # kernel names are cut to this many characters


def newest_xplane(trace_dir):
    """The newest (by modification time) `*.xplane.pb` below `trace_dir`, or None."""
    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    return max(paths, key=lambda p: (os.path.getmtime(p), p)) if paths else None


def device_events(trace_dir, plane_prefix="/device:GPU", line_contains="Stream"):
    """The kernel events of the newest trace below `trace_dir`: (start ns, duration ns, full
    name) of every event on the lines whose name contains `line_contains` of the planes whose name
    starts with `plane_prefix`, sorted by start. Times are in nanoseconds on the trace's clock
    (only differences mean anything). [] when there is no trace file."""
    from jax.profiler import ProfileData
    path = newest_xplane(trace_dir)
    if path is None:
        return []
    evs = []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for ln in plane.lines:
            if line_contains in ln.name:
                evs += [(ev.start_ns, ev.duration_ns, ev.name) for ev in ln.events]
    evs.sort()
    return evs


def kernel_summary(trace_dir, plane_prefix="/device:GPU", line_contains="Stream"):
    """Per-kernel totals of the events `device_events` finds (same arguments), as a dict:

    kernels: list, largest total first, of dict(name: the kernel's name cut to NAME_LEN
        characters, launches: number of events, total_us: summed duration in microseconds,
        mean_us: total_us / launches); kernels are told apart by their full names.
    kernel_us: the summed duration of all events, us (counts overlapping kernels twice).
    busy_us: the time at least one event runs (union of the event intervals), us.
    span_us: wall time from the first event's start to the last event's end, us
        (span_us - busy_us is the time the device sat idle between kernels).
    events: the number of events.
    """
    evs = device_events(trace_dir, plane_prefix, line_contains)
    per = collections.defaultdict(lambda: [0, 0.0])
    busy_ns, cur_start, cur_end = 0.0, None, None
    for start, dur, name in evs:   # sorted by start: merge overlapping intervals
        per[name][0] += 1
        per[name][1] += dur
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy_ns += cur_end - cur_start
            cur_start, cur_end = start, start + dur
        else:
            cur_end = max(cur_end, start + dur)
    if cur_end is not None:
        busy_ns += cur_end - cur_start
    kernels = [dict(name=name[:NAME_LEN], launches=n, total_us=ns / 1e3, mean_us=ns / 1e3 / n)
               for name, (n, ns) in sorted(per.items(), key=lambda kv: -kv[1][1])]
    span_ns = max(s + d for s, d, _ in evs) - evs[0][0] if evs else 0.0
    return dict(kernels=kernels, kernel_us=sum(d for _, d, _ in evs) / 1e3,
                busy_us=busy_ns / 1e3, span_us=span_ns / 1e3, events=len(evs))


def summary_markdown(summary, calls):
    """A markdown table of `kernel_summary`'s result for a trace of `calls` calls of one program:
    kernel, launches per call, microseconds per call, share of the summed kernel time (the
    share of the device busy time when kernels do not overlap); then the device busy time per
    call vs the wall span per call (us), whose difference is the idle time between kernels."""
    lines = ["| kernel | launches/call | us/call | share |", "|---|---|---|---|"]
    tot = summary["kernel_us"] or 1.0
    for k in summary["kernels"]:
        lines.append(f"| {k['name']} | {k['launches'] / calls:g} | {k['total_us'] / calls:.1f} |"
                     f" {k['total_us'] / tot:.1%} |")
    busy, span = summary["busy_us"] / calls, summary["span_us"] / calls
    lines.append(f"device busy {busy:.1f} us/call, wall span {span:.1f} us/call "
                 f"(idle {span - busy:.1f} us/call, busy {busy / (span or 1.0):.1%})")
    return "\n".join(lines)
