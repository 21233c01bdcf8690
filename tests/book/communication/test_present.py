"""lab.book.communication.present: notebook 06's grid plan and its claims, from small synthetic grids; the
claims' values and verdicts are checked, never their wording."""

import json
import math
import os

import matplotlib
import pandas as pd
import pytest
import torch

from lab.bench import collectives
from lab.book import claims as cl
from lab.book.communication import present as comm

matplotlib.use("Agg")
MIB = 2**20


def _row(backend, op, n, size_mb, times_ms, correct=True):
    s = cl.Measured.of("", times_ms).summary
    size = size_mb * MIB
    return dict(backend=backend, op=op, world_size=n, size_mb=size_mb, size_bytes=size, correct=correct, status="ok",
                time_ms=s.median, time_spread_ms=s.spread, time_n=s.n, samples_ms=json.dumps(times_ms),
                algbw_gbps=collectives.algorithm_bandwidth_gbps(size, s.median / 1e3),
                busbw_gbps=collectives.bus_bandwidth_gbps(op, size, s.median / 1e3, n))


def _jitter(ms, k=8):
    return [ms * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(k)]  # +-2 %, deterministic


def grid(split_factor=1.0, slow_ranks=1.0):
    """gloo, 2 and 4 ranks, 1 and 10 MiB: an all-reduce of 1 ms + 1 ms/MiB; reduce-scatter and all-gather each
    half of it times ``split_factor``; 4 ranks ``slow_ranks`` times slower than the ring factor predicts."""
    rows = []
    for n in (2, 4):
        ring = 2 * (n - 1) / n  # all-reduce traffic per link relative to 2 ranks
        for s in (1, 10):
            ar = (1 + s) * ring * (slow_ranks if n == 4 else 1.0)
            rows.append(_row("gloo", "all_reduce", n, s, _jitter(ar)))
            for op in ("reduce_scatter", "all_gather"):
                rows.append(_row("gloo", op, n, s, _jitter(ar / 2 * split_factor)))
    return pd.DataFrame(rows)


def found(claim_or_findings, kind):
    findings = claim_or_findings.findings if isinstance(claim_or_findings, cl.Claim) else claim_or_findings
    return [f for f in findings if isinstance(f, kind)]


def test_plan_grid_quick_full_and_without_gpus():
    quick = comm.plan_grid(True, gpus=8)
    assert quick.cpu_world_sizes == (2, 4, 6) and quick.gpu_world_sizes == () and max(quick.cpu_sizes_mb) <= 4
    assert 5 <= quick.iters <= 10 and "gloo only" in quick.note  # enough timed calls for a verdict
    full = comm.plan_grid(False, world_sizes=[2, 4, 6], gpus=2)
    assert full.cpu_world_sizes == (2, 4, 6) and full.gpu_world_sizes == (2,)
    assert full.gpu_sizes_mb == (1, 10, 100, 1024) and "cannot run 4, 6 ranks" in full.note
    assert comm.plan_grid(False, device="cpu", gpus=8).gpu_world_sizes == ()
    assert comm.plan_grid(False, world_sizes=[2, 4], gpus=4).note == "NCCL runs every requested world size (2, 4 GPUs)."
    assert full.params()["gpu_world_sizes"] == [2] and "note" not in full.params()
    with pytest.raises(ValueError):
        comm.plan_grid(True, ops=["broadcast"])


def test_a_replay_describes_the_machine_that_measured(tmp_path):
    """Replayed on a 2-core CPU, 06 said 'this machine has 0 GPU(s)' and '2 CPU cores' of a table measured
    on 2 H100s and 32 cores."""
    from lab.measure.results import save_results

    save_results(grid(), "collectives", tmp_path, source="06_communication")
    meta_path = tmp_path / "collectives.json"
    meta = json.loads(meta_path.read_text())
    meta["sources"]["06_communication"].update(gpu_count=2, host_cores=32)
    meta_path.write_text(json.dumps(meta))
    assert comm.measuring_machine(str(tmp_path), True) == dict(gpus=2, cores=32)
    assert comm.measuring_machine(str(tmp_path), ["collectives"]) == dict(gpus=2, cores=32)
    here = comm.measuring_machine(str(tmp_path), False)
    assert here["cores"] == os.cpu_count() and here["gpus"] == torch.cuda.device_count()


def test_grid_findings_check_values_and_shared_cores():
    g = grid()
    v = {f.label if hasattr(f, "label") else f.measured.label: f for f in comm.grid_findings(g, cores=2)}
    assert v["collectives checked element by element against closed forms"].measured.median == 12
    assert found(list(v.values()), cl.Observed)[0].seen == "none"
    assert found(list(v.values()), cl.Observed)[1].seen == "4"  # 4 processes share 2 cores
    assert found(comm.grid_findings(g, cores=8), cl.Observed)[1].seen == "none"
    assert found(comm.grid_findings(g, cores=None), cl.Observed)[1].seen == "not recorded with this table"
    g.loc[4, "correct"] = False
    wrong = found(comm.grid_findings(g, cores=8), cl.Observed)[0].seen
    assert wrong == "gloo reduce-scatter, 2 ranks, 10 MiB"
    old = g.assign(size_mb=g["size_mb"] * (1 - 1e-5))  # an older table kept the size a world size trims
    assert set(comm._ok(old)["size_mb"]) == {1, 10}


def test_split_verdicts_follow_the_samples():
    same = comm.split_comparisons(grid(split_factor=1.0))
    assert [(k["world_size"], k["size"]) for k, _ in same] == [(2, "10 MiB"), (4, "10 MiB")]
    assert [f.verdict for _, f in same] == ["within noise"] * 2
    assert same[0][1].subject.median == pytest.approx(11.0, rel=0.02) and same[0][1].reference.median == \
        pytest.approx(11.0, rel=0.02)
    slower = comm.split_comparisons(grid(split_factor=1.3))
    assert [f.verdict for _, f in slower] == ["slower"] * 2
    assert slower[0][1].comparison.ratio == pytest.approx(1.3, rel=0.03)
    faster = comm.split_claim(comm.split_comparisons(grid(split_factor=0.7)))
    assert [f.verdict for f in found(faster, cl.Versus)] == ["faster"] * 2
    table = comm.comparison_table(slower, "reduce-scatter + all-gather", "all-reduce")
    assert list(table.columns[:5]) == ["backend", "world_size", "size", "reduce-scatter + all-gather", "all-reduce"]
    assert list(table["verdict"]) == ["slower", "slower"]


def test_bus_bandwidth_holds_or_not():
    held = comm.rank_comparisons(grid())
    ((keys, f),) = held
    assert keys == dict(backend="gloo", size="10 MiB", world_size=4) and f.verdict == "within noise"
    assert f.subject.unit == "GB/s" and f.reference.median == pytest.approx(10 * MIB / 11.0 / 1e6, rel=0.02)
    assert "holds within the noise" in comm.ranks_claim(held).because
    dropped = comm.rank_comparisons(grid(slow_ranks=2.0))
    assert dropped[0][1].verdict == "lower" and dropped[0][1].comparison.ratio == pytest.approx(0.5, rel=0.03)
    assert "lower" in comm.ranks_claim(dropped).because
    rose = comm.rank_comparisons(grid(slow_ranks=0.5))  # H100 host, gloo: 2.55 GB/s on 2 ranks, 3.52 on 4
    assert rose[0][1].verdict == "higher" and "rises" in comm.ranks_claim(rose).because
    one = comm.ranks_claim(comm.rank_comparisons(grid()[lambda d: d["world_size"] == 2]))
    assert not found(one, cl.Versus) and found(one, cl.Observed)


def test_latency_claim_from_a_fit():
    fits = collectives.latency_bandwidth_fit(grid())
    ar2 = fits[(fits["op"] == "all_reduce") & (fits["world_size"] == 2)].iloc[0]
    assert ar2["latency_ms"] == pytest.approx(1.0, rel=0.05)  # 1 ms + 1 ms per MiB
    claim = comm.latency_claim(fits)
    latency, bandwidth = found(claim, cl.Value)
    assert latency.measured.median == pytest.approx(ar2["latency_ms"]) and latency.measured.unit == "ms"
    small = comm.latency_claim(fits.assign(latency_ms=fits["latency_ms"] / 10))  # below a millisecond: in µs
    assert [(v.measured.median, v.measured.unit) for v in found(small, cl.Value)][0] == (pytest.approx(
        ar2["latency_ms"] * 100), "µs")
    assert bandwidth.measured.median == ar2["bandwidth_gbps"] and "2 ranks" in latency.measured.label
    every = comm.fits_findings(fits)  # per world size: latency, bandwidth, latency-bound size, the fit's miss
    assert len(found(every, cl.Value)) == 6 and len(found(every, cl.Share)) == 2
    assert found(every, cl.Value)[2].measured.median == pytest.approx(ar2["half_latency_mb"] * MIB)
    flat = comm.fits_findings(fits.assign(bandwidth_gbps=math.nan))
    assert not found(flat, cl.Value) and all("bandwidth" in o.label for o in found(flat, cl.Observed))


def test_backend_findings_need_both_backends():
    g = grid()
    (alone,) = comm.backend_findings(g)
    assert isinstance(alone, cl.Observed)
    fast = g.assign(backend="nccl", samples_ms=[json.dumps([t / 50 for t in json.loads(s)]) for s in g["samples_ms"]])
    (versus,) = comm.backend_findings(pd.concat([g, fast]))
    assert versus.verdict == "faster" and versus.comparison.speedup == pytest.approx(50)
    assert versus.subject.label == "nccl all-reduce, 2 ranks, 10 MiB"


def test_plots_draw_from_the_grid():
    g = grid()
    (ax,) = comm.plot_times_with_fit(g, collectives.latency_bandwidth_fit(g)).axes
    assert ax.get_title() == "gloo: all-reduce" and len(ax.lines) >= 2
    assert comm.plot_bandwidth(g).axes.size == 1
    assert list(comm.grid_table(g).columns) == comm.GRID_COLUMNS
