"""lab.book.flash.grid: the grid's comparisons, tables and claims, from synthetic rows (values and verdicts)."""

import matplotlib
import pytest

from lab.accounting.attention import attention_flops
from lab.bench.attention_grid import Shape
from lab.book.claims import Tally, Versus
from lab.book.flash import grid
from tests.book.flash.rows import grid_row, table

matplotlib.use("Agg")

A, B, F = Shape(1, 16, 4096, 64), Shape(8, 16, 2048, 128, False), Shape(1, 1, 1024, 64)


def _bench():
    return table(grid_row("triton", A, ms=1.0), grid_row("sdpa", A, ms=1.2),
                 grid_row("sdpa_cudnn", A, ms=1.0, spread=0.2, n=5),
                 grid_row("pytorch_flash", A, status="skipped", note="too slow"),
                 grid_row("triton", B, ms=2.0), grid_row("sdpa", B, ms=1.0),
                 grid_row("sdpa_cudnn", B, status="unsupported"),
                 grid_row("pytorch_flash", B, ms=50.0, n=2),  # two samples: not decided
                 grid_row("triton", F, "fp32", 1.0, sweep="fp32"), grid_row("sdpa", F, "fp32", 0.5, sweep="fp32"),
                 grid_row("pytorch_naive", F, "fp32", 2.0, sweep="fp32"))


def _verdicts(pairs, pass_="e2e"):
    return {(k["shape"], k["reference_impl"]): f for k, f in pairs if k["pass"] == pass_}


def test_versus_compares_what_both_ran_timed_alike():
    pairs = grid.versus(_bench())
    e2e = _verdicts(pairs)
    assert set(e2e) == {(A.label, "sdpa"), (A.label, "sdpa_cudnn"), (B.label, "sdpa"), (B.label, "pytorch_flash")}
    assert e2e[A.label, "sdpa"].comparison.ratio == pytest.approx(1 / 1.2) and e2e[A.label, "sdpa"].verdict == "faster"
    assert e2e[A.label, "sdpa_cudnn"].verdict == "within noise"  # the reference scatters by 20%
    assert e2e[B.label, "sdpa"].verdict == "slower" and e2e[B.label, "sdpa"].comparison.ratio == pytest.approx(2.0)
    assert e2e[B.label, "pytorch_flash"].verdict == "not decided"  # fewer than 5 samples
    assert all(isinstance(f, Versus) and f.goal is None for _, f in pairs) and len(pairs) == 12
    # a replay is never set against an eager time; a replay's backward (derived, no samples) decides nothing
    mixed = table(grid_row("triton", A, timing="graph"), grid_row("sdpa", A, timing="eager"))
    assert grid.versus(mixed) == []
    alike = table(grid_row("triton", A, timing="graph", bwd_n=0), grid_row("sdpa", A, ms=2.0, timing="graph"))
    assert [k["pass"] for k, _ in grid.versus(alike)] == ["fwd", "e2e"]
    table_ = grid.comparison_table(pairs, "e2e")
    assert len(table_) == 4 and set(table_["verdict"]) == {"faster", "slower", "within noise", "not decided"}


def test_speed_and_fp32_claims_count_the_verdicts():
    bench = _bench()
    speed = grid.speed_claim(grid.versus(bench))
    counts = {f.label: f.counts() for f in speed.findings}
    assert counts == {"Triton forward + backward against sdpa": {"faster": 1, "slower": 1},
                      "Triton forward + backward against sdpa_cudnn": {"within noise": 1},
                      "Triton forward + backward against pytorch_flash": {"not decided": 1}}
    fp32 = grid.fp32_claim(grid.versus(bench, sweep="fp32"))
    by = {(f.label.split()[-1], f.label.split()[1]): f.counts() for f in fp32.findings}
    assert by["sdpa", "forward"] == {"slower": 1} and by["pytorch_naive", "forward"] == {"faster": 1}
    assert len(fp32.findings) == 6 and all(isinstance(f, Tally) for f in fp32.findings)


def test_latency_table_and_status_findings():
    bench = _bench()
    lat = grid.latency_table(bench)
    assert lat.columns.tolist()[:7] == ["shape", "dtype", "impl", "kernel", "bwd_kernel", "timing", "status"]
    assert len(lat) == 8 and lat.loc[0, "e2e_ms"] == 3.0 and lat.loc[0, "n"] == 50 and lat.loc[7, "n"] == 2
    values = {f.measured.label: f.measured.median for f in grid.status_findings(bench)}
    assert values == {"configurations measured": 9, "configurations in the grid": 11,
                      "rows of pytorch_flash skipped": 1, "rows of sdpa_cudnn unsupported": 1}


def test_parts_against_the_whole_call():
    """Forward and backward timed apart, summed (spreads in quadrature), against forward + backward in one call."""
    bench = table(grid_row("triton", A, ms=1.0, factors=(1.0, 2.4, 3.0)),  # 3.4 against 3.0: beyond the noise
                  grid_row("sdpa", A, ms=1.0, factors=(1.0, 2.0, 3.0)),  # they add up
                  grid_row("triton", B, timing="graph", bwd_n=0))  # a replay's backward is the difference: left out
    pairs = grid.parts_against_whole(bench)
    assert [(k["impl"], k["shape"]) for k, _ in pairs] == [("triton", A.label), ("sdpa", A.label)]
    summed = pairs[0][1].subject.summary
    assert summed.median == pytest.approx(3.4) and summed.spread == pytest.approx(0.01 * (1 + 2.4 ** 2) ** 0.5)
    claim = grid.parts_claim(pairs)
    assert [f.counts() for f in claim.findings] == [{"slower": 1}, {"within noise": 1}] and claim.because


def test_host_claim_sets_eager_calls_beside_replays():
    eager = dict(e2e_eager_ms=6.0, e2e_eager_spread_ms=0.06, e2e_eager_n=20)
    bench = table(grid_row("triton", A, timing="graph", **eager), grid_row("sdpa", A, timing="graph", ms=1.2, **eager),
                  grid_row("sdpa_flash", A, timing="graph", **eager), grid_row("triton", B))
    claim = grid.host_claim(bench)
    assert [f.subject.label.split()[0] for f in claim.findings] == ["triton", "sdpa"]
    assert [f.comparison.ratio for f in claim.findings] == pytest.approx([2.0, 6.0 / 3.6])
    assert all(f.verdict == "slower" for f in claim.findings)
    assert len(grid.host_table(bench)) == 3 and grid.host_table(table(grid_row("triton", B))).empty


def test_host_claim_tells_the_dtypes_of_one_shape_apart():
    eager = dict(e2e_eager_ms=6.0, e2e_eager_spread_ms=0.06, e2e_eager_n=20)
    bench = table(*(grid_row("triton", A, dtype=dt, timing="graph", **eager) for dt in ("bf16", "fp16")))
    labels = [f.subject.label for f in grid.host_claim(bench).findings]
    assert len(set(labels)) == 2 and "bf16" in labels[0] and "fp16" in labels[1]


def test_tflops_findings_and_heatmap():
    bench = _bench()
    values = {f.measured.label: f.measured.median for f in grid.tflops_claim(bench).findings}
    a, b = (attention_flops(s.batch, s.seq, s.d, s.causal, "e2e", heads=s.heads) / 1e12 for s in (A, B))
    assert values["triton's best forward + backward in bf16"] == pytest.approx(max(a / 3e-3, b / 6e-3))
    assert values["the best other forward + backward in bf16 (sdpa)"] == pytest.approx(b / 3e-3)  # sdpa on B
    assert grid.tflops_table(bench).loc[0, "triton"] == pytest.approx(a / 3e-3)
    assert grid.plot_speedup_heatmap(grid.versus(bench)) is not None and grid.plot_speedup_heatmap([]) is None
