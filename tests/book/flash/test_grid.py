"""lab.book.flash.grid: notebook 05's grid tables, speedups, goals and fp32 sweep, from small synthetic tables."""

import math
import re

import matplotlib
import pandas as pd
import pytest

from lab.book.flash import bench as fl
from lab.book.flash import goals as gl
from lab.book.flash import grid, present
from tests.book.prose import amounts, clause_of, counts, in_order, numbers, sentence_of

matplotlib.use("Agg")

GPU = "NVIDIA H100 80GB HBM3"


def _row(impl, shape, dtype, ms, std=0.01, n=50, sweep="lm", status="ok", note="", gpu=GPU):
    row = dict(sweep=sweep, impl=impl, dtype=dtype, batch=shape.batch, heads=shape.heads, seq_len=shape.seq,
               d=shape.d, causal=shape.causal, gpu=gpu, status=status, note=note)
    for p, factor in (("fwd", 1.0), ("bwd", 2.0), ("e2e", 3.0)):
        t = ms * factor if status == "ok" else math.nan
        row.update({f"{p}_ms": t, f"{p}_mean_ms": t, f"{p}_std_ms": std * t, f"{p}_n": n if status == "ok" else 0})
    return row


A, B = fl.Shape(1, 16, 4096, 64), fl.Shape(8, 16, 2048, 128, False)


def _bench(gpu=GPU):
    rows = [_row("triton", A, "bf16", 1.0, gpu=gpu), _row("sdpa", A, "bf16", 1.2, gpu=gpu),
            _row("sdpa_cudnn", A, "bf16", 1.0, std=0.2, n=5, gpu=gpu),
            _row("pytorch_flash", A, "bf16", 0, status="skipped", note="not run beyond 2048 tokens", gpu=gpu),
            _row("triton", B, "bf16", 2.0, gpu=gpu), _row("sdpa", B, "bf16", 1.0, gpu=gpu),
            _row("sdpa_cudnn", B, "bf16", 0, status="unsupported", note="not supported: no kernel", gpu=gpu),
            _row("pytorch_flash", B, "bf16", 50.0, n=1, gpu=gpu),  # one sample: no spread
            _row("triton", fl.Shape(1, 1, 1024, 64), "fp32", 1.0, sweep="fp32", gpu=gpu),
            _row("sdpa", fl.Shape(1, 1, 1024, 64), "fp32", 0.5, sweep="fp32", gpu=gpu),
            _row("pytorch_naive", fl.Shape(1, 1, 1024, 64), "fp32", 2.0, sweep="fp32", gpu=gpu)]
    return fl.add_tflops(pd.DataFrame(rows))


def test_latency_and_status_tables():
    bench = _bench()
    lat = grid.latency_table(bench, "lm")
    assert lat.columns.tolist() == ["shape", "dtype", "triton", "sdpa", "sdpa_cudnn", "pytorch_flash"]
    assert lat.iloc[0]["shape"] == "1x16x4096 d64 causal" and lat.iloc[0]["triton"] == "1 / 2 / 3"
    assert lat.iloc[0]["pytorch_flash"] == "skipped" and lat.iloc[1]["sdpa_cudnn"] == "unsupported"
    graph = grid.latency_table(bench.assign(timing=["graph"] * 4 + ["eager"] * 7), "lm")
    assert graph.iloc[0]["triton"] == "1 / 2 / 3 (graph)" and graph.iloc[1]["triton"] == "2 / 4 / 6"
    st = grid.status_table(bench)
    assert st["status"].tolist() == ["skipped", "unsupported"] and "2048" in st["note"].iloc[0]
    assert grid.status_sentence(bench) == ("9 of 11 configurations ran. The rest: pytorch_flash skipped ×1; "
                                              "sdpa_cudnn unsupported ×1 (the table gives each reason).")


def test_speedups_sentences_and_heatmap():
    bench = _bench()
    sp = grid.speedup_table(bench, "lm")
    e2e = sp[sp["pass"] == "e2e"].set_index(["shape", "reference"])
    assert e2e.loc[("1x16x4096 d64 causal", "sdpa"), "speedup"] == pytest.approx(1.2)
    assert e2e.loc[("1x16x4096 d64 causal", "sdpa"), "verdict"] == "faster"
    assert e2e.loc[("1x16x4096 d64 causal", "sdpa_cudnn"), "verdict"] == "within noise"
    assert e2e.loc[("8x16x2048 d128 full", "sdpa"), "verdict"] == "slower"
    assert e2e.loc[("8x16x2048 d128 full", "pytorch_flash"), "speedup"] == pytest.approx(25.0)
    shown = grid.speedup_display(sp, "e2e")
    assert shown.iloc[0]["sdpa"] == "1.2x faster" and shown.iloc[0]["sdpa_cudnn"] == "1x ≈"
    assert shown.iloc[1]["pytorch_flash"] == "25x (1 sample)"  # not "≈": no noise was measured
    assert grid.speedup_display(sp, "e2e", interpreted_=True).iloc[0]["sdpa"] == "1.2x"
    text = grid.speed_sentence(sp)
    sdpa, cudnn, flash = text.split(";")  # one clause per reference: faster, slower, within noise on k of n
    assert "Triton" in sdpa and "sdpa" in sdpa and sdpa.index("faster") < sdpa.index("slower") < sdpa.index("within")
    assert numbers(sdpa)[-6:] == [1, 1, 0, 2, 0.5, 1.2] and amounts(sdpa) == [(1.2, "x")]  # counts, speedup range
    assert "sdpa_cudnn" in cudnn and numbers(cudnn) == [0, 0, 1, 1, 1, 1]
    assert "pytorch_flash" in flash and numbers(flash) == [1, 1, 25, 25] and "no spread" in flash
    assert "faster" not in flash and "no verdict" in flash
    assert grid.speed_sentence(sp, interpreted_=True) == present.INTERPRETED_SHORT
    assert grid.plot_speedup_heatmap(sp) is not None
    tf = grid.tflops_table(bench, "lm")
    assert tf.iloc[0]["triton"] == pytest.approx(fl.attention_flops(1, 4096, 64, True, "e2e", heads=16) / 3e-3 / 1e12)
    tf = grid.tflops_sentence(bench)  # Triton's best forward, backward, end to end; the best other's end to end
    assert amounts(tf) == [(137, "TFLOP/s")] and numbers(tf) == [137, 172, 160, 321] and "bf16" in tf and "sdpa" in tf
    assert tf.startswith("In bf16, Triton reaches at best") and tf.endswith("each pass on its own best shape.")


def test_goals_sentence():
    bench = _bench()
    goals = gl.flash_goals(bench)
    shown = grid.goals_display(goals)
    assert shown["shape"].tolist() == ["1x16x4096 d64 causal", "8x16x2048 d128 full"]
    assert shown["targets"].tolist() == ["fwd ≥ 1, bwd ≥ 0.9, e2e ≥ 0.95"] * 2
    text = grid.goals_sentence(goals)
    tally, furthest = text.split(". ")[:2]
    assert amounts(tally) == [(1, "x"), (0.9, "x"), (0.95, "x")]  # the goals of each pass
    for p in ("fwd:", "bwd:", "e2e:"):  # met, missed, undecided of n
        assert numbers(clause_of(tally, p)) == [1, 1, 0, 2] and clause_of(tally, p).index("met") < clause_of(
            tally, p).index("missed") < clause_of(tally, p).index("undecided")
    assert "fwd" in furthest and "8x16x2048 d128 full" in furthest and "bwd" not in furthest
    assert amounts(furthest) == [(0.5, "x"), (1, "x"), (50, "%")] and "below" in furthest
    met = grid.goals_sentence(gl.flash_goals(bench[bench["seq_len"] == 4096]))
    assert "met" in met and "missed" not in met and "1x16x4096 d64 causal" in met and "above" in met
    assert amounts(met) == [(1, "x"), (0.9, "x"), (0.95, "x"), (1.2, "x"), (1, "x"), (20, "%")]  # goals; the closest
    none = grid.goals_sentence(gl.flash_goals(bench[bench["heads"] < 16]))
    assert not amounts(none) and "met" not in none and "missed" not in none and numbers(none) == [16]
    interpreted_text = grid.goals_sentence(goals, interpreted_=True)
    assert present.INTERPRETED_SHORT in interpreted_text and not amounts(interpreted_text)
    assert "met" not in interpreted_text and "missed" not in interpreted_text


def test_fp32_sentence_says_whether_triton_is_ever_slower():
    text = grid.fp32_sentence(_bench())
    sdpa, naive = text.split(";")
    assert text.startswith("Yes") and "sdpa" in sdpa and "pytorch_naive" in naive
    assert re.findall(r"(\d+) of (\d+)", sdpa) == [("1", "1")] * 3  # slower in each pass's one configuration
    assert "1x1x1024 d64 causal" in sdpa and "0.5x" in sdpa  # the end-to-end shape and its speed
    assert "never" in naive and not re.findall(r"\d+ of \d+", naive)
    faster = _bench()
    faster.loc[(faster["sweep"] == "fp32") & (faster["impl"] == "sdpa"), ["fwd_mean_ms", "bwd_mean_ms",
                                                                          "e2e_mean_ms"]] = [5.0, 10.0, 15.0]
    never = grid.fp32_sentence(faster)
    assert never.startswith("No") and not counts(never) and not amounts(never) and never.count("never") == 2
    interpreted_text = grid.fp32_sentence(_bench(), interpreted_=True)
    assert present.INTERPRETED_SHORT in interpreted_text and not counts(interpreted_text)
    assert not interpreted_text.startswith(("Yes", "No"))  # no answer either way


def test_interpreted_is_read_from_the_rows():
    assert present.interpreted(_bench(gpu="cpu")) and not present.interpreted(_bench())
    assert present.interpreted(pd.DataFrame(dict(device=["cpu"])))
    assert not present.interpreted(pd.DataFrame(dict(device=["cuda:0"])))


def test_why_missed_reads_the_gap_by_head_dimension():
    rows = [(64, 0.96, 0.85, 0.87), (80, 0.70, 0.65, 0.66), (80, 0.68, 0.63, 0.66), (128, 0.73, 0.73, 0.74)]
    goals = pd.DataFrame([dict(d=d, fwd_ratio=f, bwd_ratio=b, e2e_ratio=e) for d, f, b, e in rows])
    t = grid.why_missed_table(goals).set_index("d")
    assert t.loc[80, "shapes"] == 2 and t.loc[80, "fwd_median"] == pytest.approx(0.69)
    assert t.loc[80, "useful_columns"] == 0.625 and t.loc[128, "useful_columns"] == 1.0
    text = grid.why_missed_sentence(goals)
    d80 = clause_of(text, "d 80")  # forward, backward, end to end
    assert amounts(d80) == [(0.69, "x"), (0.64, "x"), (0.66, "x")] and d80.index("forward") < d80.index("backward")
    furthest = text.split(". ")[1]  # 0.69 / 1.0 below 0.64 / 0.9
    assert numbers(furthest) == [80] and "forward" in furthest and "backward" not in furthest
    # the powers of two's forward median: (0.96 + 0.73) / 2
    masked = sentence_of(text, 62.5, "%")
    assert numbers(masked) == [80, 62.5, 128, 0.69, 0.845] and amounts(masked)[1:] == [(0.69, "x"), (0.845, "x")]
    products = sentence_of(text, 0.714, "x")
    assert counts(products) == [(2, 3)] and in_order(products, [7, 5, 0.714])  # d 128: equal, not behind
    assert products.index("backward") < products.index("forward")  # the backward trails the forward
    unexamined = grid.why_missed_sentence(goals, interpreted_=True)
    assert not amounts(unexamined) and not numbers(unexamined)
    # measured on a GPU in bf16, d = 80 runs as 64 + 16 columns: no masked tile is claimed
    on_gpu = goals.assign(dtype="bf16", seq_len=2048, gpu="NVIDIA H100 80GB HBM3")
    assert grid.why_missed_table(on_gpu).set_index("d").loc[80, "useful_columns"] == 1.0
    split = grid.why_missed_sentence(on_gpu)
    assert "masked" not in split.replace("no masked", "")
    chunks = next(part for part in split.split(". ") if "no masked" in part)
    assert numbers(chunks) == [80, 0.69, 0.845]


def test_host_table_sets_eager_calls_beside_graph_replays():
    bench = _bench()
    assert grid.host_table(bench).empty and grid.host_sentence(grid.host_table(bench)) == ""  # no graph timing
    graph = ["graph", "graph"] + ["eager"] * 9
    bench = bench.assign(timing=graph, e2e_eager_ms=[6.0, 4.8] + [math.nan] * 9, fwd_eager_ms=[2.0, 1.6] + [
        math.nan] * 9)
    t = grid.host_table(bench)
    assert t["impl"].tolist() == ["triton", "sdpa"] and t["e2e_graph_ms"].tolist() == pytest.approx([3.0, 3.6])
    assert t["e2e_host_share"].tolist() == pytest.approx([0.5, 0.25])
    text = grid.host_sentence(t)
    assert numbers(text)[1:5] == [6000, 3000, 4800, 3600]  # triton eager, replayed; sdpa eager, replayed
    assert text.index("triton") < text.index("sdpa") and "1x16x4096 d64 causal" in text


def test_goals_against_flex_attention():
    """The FlexAttention goals (fwd, bwd >= 1x) through the same table and sentence, naming their reference."""
    bench = _bench()
    bench = pd.concat([bench, bench[bench["impl"] == "sdpa"].assign(impl="flex")], ignore_index=True)
    goals = gl.flash_goals(bench, reference="flex", goals=gl.FLEX_GOALS, shape_goals={})
    assert (goals["reference"] == "flex").all() and "e2e_ratio" not in goals.columns
    shown = grid.goals_display(goals)
    assert "e2e_goal" not in shown.columns and shown["targets"].tolist() == ["fwd ≥ 1, bwd ≥ 1"] * 2
    text = grid.goals_sentence(goals, gl.FLEX_GOALS, reference="FlexAttention")
    assert "FlexAttention's speed" in text and "e2e" not in text and "SDPA" not in text
