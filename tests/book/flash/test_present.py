"""lab.book.flash.present: notebook 05's settings, tables and sentences, from small synthetic tables (the grid's in
test_flash_grid.py)."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book.flash import bench as fl
from lab.book.flash import present
from tests.book.prose import amounts, clause_of, in_order, numbers

matplotlib.use("Agg")

GPU = "NVIDIA H100 80GB HBM3"


def _knobs(**given):
    knobs = dict(check_impls=None, check_ds=None, check_dtypes=["bf16", "fp32"], check_seq=None,
                 impls=["triton", "sdpa"], shapes=None, dtypes=["bf16", "fp16"], pytorch_flash_max_seq=None,
                 pytorch_flash_dtypes=["bf16"], fp32_impls=["triton", "sdpa", "pytorch_naive"], fp32_seqs=None,
                 fp32_ds=None, warmup_ms=5, rep_ms=20, cpu_steps=2, course_shape=None, course_compile=None,
                 course_goal_ms=4.6, lm_size=None, lm_context=None, lm_batch=None, lm_dtype=None, lm_compile=None,
                 lm_warmup=None, lm_steps=None, ceiling_n=None)
    knobs.update(given)
    return knobs


def test_settings_profiles_shapes_and_variants():
    full = present.settings(False, "cuda", **_knobs())
    assert full.shapes == fl.LM_SHAPES and full.check_ds == (64, 80, 96, 128) and full.lm_size == "2.7B"
    assert full.course_shape == (16, 16384, 64) and full.course_compile == (True, False)
    assert full.lm_variants == [dict(attention="sdpa", compile=False), dict(attention="flash_triton", compile=False),
                                dict(attention="sdpa", compile=True), dict(attention="flash_triton", compile=True)]
    sweeps = full.sweeps
    assert sweeps["lm"]["dtypes"] == ("bf16", "fp16") and sweeps["fp32"]["dtypes"] == ("fp32",)
    assert len(sweeps["fp32"]["shapes"]) == 6 and sweeps["lm"]["skip"]("pytorch_flash", fl.LM_SHAPES[0], "bf16")
    quick = present.settings(True, "cpu", **_knobs(shapes=[[1, 2, 32, 16, True]]))
    assert quick.shapes == (fl.Shape(1, 2, 32, 16, True),) and quick.lm_variants == [
        dict(attention="sdpa", compile=False), dict(attention="flash_triton", compile=False)]
    assert "triton_compiled_bwd" not in quick.check_impls and quick.course_compile == (False,)
    assert quick.params()["shapes"] == [[1, 2, 32, 16, True]]
    # FlexAttention runs only compiled: in the full profile's grid, not in the quick one's
    assert "flex" in present.settings(False, "cuda", **_knobs(impls=None)).impls
    assert "flex" not in present.settings(True, "cpu", **_knobs(impls=None)).impls
    assert (full.ceiling_n, quick.ceiling_n) == (8192, 256)


def _errors(impl, dtype, d, worst, status="ok"):
    e = worst if status == "ok" else math.nan
    return dict(impl=impl, dtype=dtype, d=d, seq_len=64, out=e / 2, dq=e, dk=e / 3, dv=e / 4, status=status,
                note="" if status == "ok" else "not supported: ValueError: head dimension d=80 is not supported")


def test_correctness_summary_and_sentence():
    errors = pd.DataFrame([
        _errors("pytorch_naive", "bf16", 64, 1e-2), _errors("pytorch_naive", "bf16", 80, 2e-2),
        _errors("triton", "bf16", 64, 2e-2), _errors("triton", "bf16", 80, 0, status="unsupported"),
        _errors("sdpa_cudnn", "bf16", 64, 0, status="unsupported"),
        _errors("sdpa_cudnn", "bf16", 80, 0, status="unsupported"),
        _errors("pytorch_naive", "fp32", 64, 5e-8), _errors("sdpa", "fp32", 64, 2e-7)])
    s = present.correctness_summary(errors).set_index(["impl", "dtype"])
    assert s.loc[("triton", "bf16"), "ratio_to_naive"] == pytest.approx(2.0)
    assert s.loc[("triton", "bf16"), "verdict"] == "agrees" and s.loc[("triton", "bf16"), "unsupported_d"] == "80"
    assert s.loc[("sdpa_cudnn", "bf16"), "verdict"] == "not supported"
    # naive fp32's error 5e-8 is below the floor of one fp32 epsilon (1.19e-7): the ratio is taken to the floor
    assert s.loc[("sdpa", "fp32"), "ratio_to_naive"] == pytest.approx(2e-7 / 2**-23)
    text = present.correctness_sentence(present.correctness_summary(errors))
    verdict, unsupported = text.split(". ")
    assert "agrees" in verdict and amounts(verdict) == [(4, "x"), (2, "x")]  # the bound, then the worst's ratio
    assert "triton" in clause_of(verdict, "worst") and "bf16" in clause_of(verdict, "worst")  # the worst, named
    assert "triton bf16" in unsupported and numbers(unsupported) == [80] and "sdpa_cudnn bf16" in unsupported
    assert "pytorch_naive" not in unsupported
    bad = pd.concat([errors, pd.DataFrame([_errors("triton", "fp32", 64, 1e-3)])], ignore_index=True)
    text = present.correctness_sentence(present.correctness_summary(bad))
    beyond = text.split(". ")[0]
    assert "agrees" not in beyond and amounts(beyond) == [(4, "x"), (8390, "x")] and "triton fp32" in beyond
    assert "sdpa" not in beyond and "pytorch_naive" not in beyond  # only the one beyond the bound is named


def _course(ms, std, gpu, compiled=True, n=20):
    return dict(test="course flash timing", compiled=compiled, batch=16, seq_len=16384, d=64, dtype="bf16",
                causal=True, ms=ms, mean_ms=ms, std_ms=std, n=n, gpu=gpu, goal_ms=4.6)


def test_course_sentence_and_goal():
    h100 = pd.DataFrame([_course(4.0, 0.05, GPU), _course(4.59, 0.3, GPU, compiled=False)])
    assert present.course_table(h100)["goal"].tolist() == ["met", "undecided (within noise)"]
    text = present.course_sentence(h100)
    assert numbers(clause_of(text, "compiled")) == [4, 0.05, 20] and numbers(clause_of(text, "eager"))[:3] == [
        4.59, 0.3, 20]  # median ms, its spread, samples
    assert GPU in text
    goals = text[text.index("Against 4.6 ms"):]  # each time as a multiple of the goal, then the verdict
    compiled_goal, eager_goal = goals.split(";")
    assert "compiled" in compiled_goal and "met" in compiled_goal and amounts(compiled_goal)[1] == (0.87, "x")
    assert "eager" in eager_goal and "undecided" in eager_goal and amounts(eager_goal)[0] == (0.998, "x")
    h200 = pd.DataFrame([_course(5.0, 0.05, "NVIDIA H200")])
    text = present.course_sentence(h200)
    assert "NVIDIA H200" in text and "H100" in text  # the card it ran on, the goal's card
    assert "missed" not in text and "over the H100 goal (pointer only)" in text  # a pointer, not a verdict
    assert present.course_table(h200)["goal"].tolist() == ["over the H100 goal (pointer only)"]
    assert present.course_table(pd.DataFrame([_course(4.0, 0.05, "NVIDIA H200")]))["goal"].tolist() == [
        "under the H100 goal (pointer only)"]
    cpu = pd.DataFrame([_course(400.0, 10.0, "cpu", compiled=False, n=2)])
    assert present.course_table(cpu)["goal"].tolist() == ["not evaluated (CPU)"]
    assert "not evaluated" in present.course_sentence(cpu) and present.INTERPRETED_SHORT in \
        present.course_sentence(cpu)


def _lm(attention, compile, step, std=0.01, device="cuda:0", status="ok"):
    return dict(size="2.7B", context=512, batch=4, dtype="bf16", attention=attention, compile=compile, steps=5,
                step_ms=step, step_std_ms=std * step, step_peak_gib=40.0, device=device, status=status)


def test_lm_versus_and_sentence():
    lm = pd.DataFrame([_lm("sdpa", False, 400.0), _lm("flash_triton", False, 380.0),
                       _lm("sdpa", True, 300.0), _lm("flash_triton", True, 301.0, std=0.2)])
    vs = present.lm_versus(lm).set_index(["attention", "compile"])
    assert vs.loc[("flash_triton", False), "speedup_vs_sdpa"] == pytest.approx(400 / 380)
    assert vs.loc[("flash_triton", False), "verdict_vs_sdpa"] == "faster"
    assert vs.loc[("flash_triton", True), "verdict_vs_sdpa"] == "within noise"
    assert vs.loc[("sdpa", True), "verdict_vs_eager"] == "faster" and vs.loc[("sdpa", False), "verdict_vs_sdpa"] == ""
    text = present.lm_sentence(lm, present.lm_versus(lm))
    head = text.split(":")[0]
    assert numbers(head) == [2.7, 4, 512] and "bf16" in head and "FlashAttention-Triton" in head
    eager = clause_of(text, "eager")
    assert amounts(eager) == [(380, "ms"), (400, "ms"), (1.05, "x")] and "faster" in eager
    compiled = clause_of(text, "compiled")
    assert amounts(compiled) == [(301, "ms"), (300, "ms"), (0.997, "x")] and "within noise" in compiled
    compiling = text.split(". ")[-1]  # compiled against eager, per attention
    assert "faster" in clause_of(compiling, "sdpa") and amounts(clause_of(compiling, "flash_triton")) == [(1.26, "x")]
    cpu = pd.DataFrame([_lm("sdpa", False, 400.0, device="cpu"), _lm("flash_triton", False, 4000.0, device="cpu")])
    text = present.lm_sentence(cpu, present.lm_versus(cpu))
    assert "slower" not in text and present.INTERPRETED_SHORT in text
    assert (present.lm_versus(cpu)["verdict_vs_sdpa"] == "").all()
    failed = pd.DataFrame([_lm("sdpa", False, 400.0), _lm("flash_triton", False, math.nan, status="oom")])
    text = present.lm_sentence(failed, present.lm_versus(failed))
    assert "FlashAttention-Triton" in text and not amounts(text) and "faster" not in text and "slower" not in text


def test_backward_table_and_sentence():
    """Each timed Triton backward against the matmul ceiling of its dtype: products per tile pair of its
    launch mode, useful (5-product) and executed (products x BLOCK_D / d) rates; rows with no time or no
    mode are left out; the sentence quotes the share's range and the modes."""
    base = dict(sweep="lm", impl="triton", dtype="bf16", batch=4, heads=32, causal=True, status="ok")
    bench = pd.DataFrame([
        dict(base, seq_len=512, d=80, bwd_ms=0.2, bwd_mode="fused"),
        dict(base, seq_len=4096, d=128, bwd_ms=4.0, bwd_mode="two_pass"),
        dict(base, seq_len=4096, d=64, bwd_ms=math.nan, bwd_mode="two_pass"),  # no time
        dict(base, seq_len=4096, d=64, bwd_ms=1.0, bwd_mode=math.nan),  # an old row without the mode
        dict(base, impl="sdpa", seq_len=512, d=80, bwd_ms=0.1),
    ])
    ceilings = pd.DataFrame([dict(dtype="bf16", n=8192, tflops=700.0)])
    table = present.backward_table(bench, ceilings)
    assert list(table["shape"]) == ["4x32x512x80", "4x32x4096x128"] and list(table["products"]) == [7, 7]
    useful = fl.attention_flops(4, 512, 80, True, "bwd", heads=32) / 0.2e-3 / 1e12
    first = table.iloc[0]
    assert first["useful_tflops"] == pytest.approx(useful)
    assert first["executed_tflops"] == pytest.approx(useful * 7 / 5 * 128 / 80)
    assert first["of_ceiling"] == pytest.approx(first["executed_tflops"] / 700.0)
    text = present.backward_sentence(table)
    shares = sorted(100 * table["of_ceiling"])
    assert f"{shares[0]:.2g}-{shares[1]:.2g}%" in text and "fused" in text and "two_pass" in text and "700" in text
    assert "700" not in present.backward_sentence(table, interpreted_=True)
    assert present.backward_table(bench, ceilings.iloc[:0])["of_ceiling"].isna().all()


def test_forward_table_sets_both_kernels_against_the_ceiling():
    """The useful forward rate (two products on d columns) of Triton and SDPA on each shape both ran, each as a
    share of the dtype's ceiling; Triton's executed rate counts its padded columns; a shape SDPA lacks is left
    out; the sentence quotes each head dimension's shares."""
    base = dict(sweep="lm", dtype="bf16", batch=4, heads=32, causal=True, status="ok", gpu="NVIDIA H200")
    bench = pd.DataFrame([
        dict(base, impl="triton", seq_len=2048, d=128, fwd_ms=0.5),
        dict(base, impl="sdpa", seq_len=2048, d=128, fwd_ms=0.4),
        dict(base, impl="triton", seq_len=2048, d=96, fwd_ms=0.3, dtype="fp32"),  # no SDPA row: left out
        dict(base, impl="triton", seq_len=512, d=80, fwd_ms=0.1),
        dict(base, impl="sdpa", seq_len=512, d=80, fwd_ms=0.05),
    ])
    ceilings = pd.DataFrame([dict(dtype="bf16", n=8192, tflops=700.0)])
    table = present.forward_table(bench, ceilings)
    assert list(table["shape"]) == ["4x32x2048x128", "4x32x512x80"]
    work = fl.attention_flops(4, 2048, 128, True, "fwd", heads=32)
    first = table.iloc[0]
    assert first["triton_tflops"] == pytest.approx(work / 0.5e-3 / 1e12)
    assert first["triton_of_ceiling"] == pytest.approx(work / 0.5e-3 / 1e12 / 700)
    assert first["reference_of_ceiling"] == pytest.approx(work / 0.4e-3 / 1e12 / 700)
    assert first["triton_executed_tflops"] == pytest.approx(first["triton_tflops"])  # d 128: no padding
    short = table.iloc[1]  # d 80 on a GPU: split 64 + 16 columns, nothing padded
    assert short["triton_executed_tflops"] == pytest.approx(short["triton_tflops"])
    text = present.forward_sentence(table)
    for d, row in ((128, first), (80, short)):
        clause = text[text.index(f"d {d}:"):]
        assert in_order(clause, [d, float(f"{100 * row['triton_of_ceiling']:.2g}"),
                                 float(f"{100 * row['reference_of_ceiling']:.2g}")])
    assert "700" in text and "700" not in present.forward_sentence(table, interpreted_=True)
    assert "No forward" in present.forward_sentence(present.forward_table(bench, ceilings.iloc[:0]))


def test_kernel_columns_follow_the_split_the_measuring_device_made():
    """d = 80 in bf16: a GPU's forward runs 64 + 16 columns at every length, its backward only on long
    sequences; the interpreter (rows measured on the CPU) never splits; a recorded count wins."""
    gpu = dict(dtype="bf16", d=80, gpu="NVIDIA H100 80GB HBM3")
    assert fl.kernel_columns(dict(gpu, seq_len=512), "fwd") == 80
    assert fl.kernel_columns(dict(gpu, seq_len=512), "bwd") == 128
    assert fl.kernel_columns(dict(gpu, seq_len=4096), "bwd") == 80
    assert fl.kernel_columns(dict(gpu, seq_len=4096, gpu_name="x", fwd_columns=128), "fwd") == 128
    assert fl.kernel_columns(dict(gpu, seq_len=4096, gpu="cpu"), "fwd") == 128
    assert fl.kernel_columns(dict(gpu, seq_len=4096, dtype="fp32"), "fwd") == 128
    assert fl.kernel_columns(dict(d=80), "fwd") == 128  # nothing to tell: one masked tile
    # the backward's executed rate counts the columns really computed: 80 on a split long sequence
    base = dict(sweep="lm", impl="triton", batch=1, heads=32, causal=False, status="ok", bwd_mode="two_pass", **gpu)
    table = present.backward_table(pd.DataFrame([dict(base, seq_len=4096, bwd_ms=1.2)]),
                                   pd.DataFrame([dict(dtype="bf16", n=8192, tflops=700.0)]))
    useful = fl.attention_flops(1, 4096, 80, False, "bwd", heads=32) / 1.2e-3 / 1e12
    assert table.iloc[0]["executed_tflops"] == pytest.approx(useful * 7 / 5)
