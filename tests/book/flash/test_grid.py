"""lab.book.flash.grid: notebook 05's grid tables, speedups, goals and fp32 sweep, from small synthetic tables."""

import math
import re

import matplotlib
import pandas as pd
import pytest

from lab.book.flash import bench as fl
from lab.book.flash import grid, present

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
    assert text.startswith("Triton, end to end (forward + backward): against sdpa faster on 1, slower on 1, "
                           "within noise on 0 of 2 (speedup 0.5–1.2x)")
    assert "against sdpa_cudnn faster on 0, slower on 0, within noise on 1 of 1" in text
    assert "against pytorch_flash faster on 0, slower on 0, within noise on 0, one sample (no spread) on 1 of 1" in text
    assert grid.speed_sentence(sp, interpreted_=True) == present.INTERPRETED_SHORT
    assert grid.plot_speedup_heatmap(sp) is not None
    tf = grid.tflops_table(bench, "lm")
    assert tf.iloc[0]["triton"] == pytest.approx(fl.attention_flops(1, 4096, 64, True, "e2e", heads=16) / 3e-3 / 1e12)
    assert "Triton reaches bf16: at best" in grid.tflops_sentence(bench)


def test_goals_sentence():
    bench = _bench()
    goals = fl.flash_goals(bench)
    shown = grid.goals_display(goals)
    assert shown["shape"].tolist() == ["1x16x4096 d64 causal", "8x16x2048 d128 full"]
    text = grid.goals_sentence(goals)
    assert text.startswith("The goals (fwd ≥ 1x, bwd ≥ 0.9x, e2e ≥ 0.95x SDPA's speed) do not all hold: "
                           "fwd: 1 met, 1 missed, 0 undecided of 2")
    assert "Furthest from its goal: fwd on 8x16x2048 d128 full bf16 at 0.5x against a goal of 1x (50% below it)" in text
    met = fl.flash_goals(bench[bench["seq_len"] == 4096])
    assert grid.goals_sentence(met).startswith("All goals met on all 1 configurations")
    assert "No configuration qualifies" in grid.goals_sentence(fl.flash_goals(bench[bench["heads"] < 16]))
    assert "not evaluated on interpreted Triton" in grid.goals_sentence(goals, interpreted_=True)


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
    assert grid.fp32_sentence(faster).startswith("No: in fp32")
    assert "GPU question" in grid.fp32_sentence(_bench(), interpreted_=True)


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
    assert "d 80: forward 0.69x, backward 0.64x, end to end 0.66x" in text
    assert "Furthest from its goal: the forward at d 80." in text  # 0.69 / 1.0 below 0.64 / 0.9
    # the powers of two's forward median: (0.96 + 0.73) / 2
    assert "only 62.5% of each tile's columns are the head's (masked 128-wide tiles)" in text
    assert "its forward is 0.69x against 0.845x at the powers of two" in text
    assert "trails the forward at 2 of 3 head dimensions" in text  # d 128: equal, not behind
    assert "would reach 0.714x" in text
    assert "not examined" in grid.why_missed_sentence(goals, interpreted_=True)
