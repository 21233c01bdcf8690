"""Synthetic ``torch.profiler`` (Kineto) Chrome traces for the trace readers' tests."""

import json


def write_trace(path, ranges, kernels, extra=()):
    """Write a trace to ``path``: CPU ranges ``(name, ts_us, dur_us)`` on thread 1, and kernels
    ``(name, ts_us, dur_us, stream, launch_ts_us, launch_tid)``, each with the ``cudaLaunchKernel`` that launched
    it (matched by correlation id); ``extra``: more events as they are. Returns ``path``."""
    ev = [dict(ph="X", cat="user_annotation", name=n, ts=ts, dur=d, tid=1) for n, ts, d in ranges] + list(extra)
    for c, (name, ts, dur, stream, launch, tid) in enumerate(kernels):
        ev.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=launch, dur=1, tid=tid,
                       args={"correlation": c}))
        ev.append(dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, tid=stream,
                       args={"stream": stream, "correlation": c}))
    path.write_text(json.dumps({"traceEvents": ev}))
    return path
