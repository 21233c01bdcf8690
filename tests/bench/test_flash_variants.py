"""lab.bench.flash_variants: the variant sweep's variants, error and time accounting, best variants, and a check
of the variants on the CPU (interpreted kernels)."""

import pandas as pd
import pytest
import torch

from lab.bench import flash_variants as fv
from lab.bench.attention_grid import Shape


def test_a_sweep_can_time_only_the_named_variants():
    variants = fv.sweep_configs()
    picked = fv.select_variants(variants, ["two_pass 64x64 w4 s3", "default"])
    assert list(picked) == ["default", "two_pass 64x64 w4 s3"]  # the sweep's order
    assert picked["two_pass 64x64 w4 s3"][0].backward_launch == "two_pass"
    assert fv.select_variants(variants, None) is variants and fv.select_variants(variants, []) is variants
    with pytest.raises(ValueError, match="unknown variant 'two_pass 1x1'.*the sweep has: default"):
        fv.select_variants(variants, ["two_pass 1x1"])


def test_sweep_configs_cover_the_launches_and_passes():
    variants = fv.sweep_configs()
    assert variants["default"][1] == fv.PASSES
    assert {cfg.backward_launch for cfg, passes in variants.values() if passes == ("bwd",)} == set(fv.PRODUCTS)
    fwd = [cfg for cfg, passes in variants.values() if passes == ("fwd",)]
    assert len(fwd) == len(fv.SWEEP_FWD_TILES) + len(fv.SWEEP_FWD) and all(len(cfg.fwd_tiles) == 4 for cfg in fwd)


def test_relative_errors_and_backward_breakdown():
    ref = [torch.tensor([1.0, -4.0]), torch.tensor([2.0, 0.0])]
    got = [torch.tensor([1.0, -3.6]), torch.tensor([2.0, 0.1])]
    assert fv.relative_errors(got, ref) == pytest.approx(0.1)  # max(0.4 / 4, 0.1 / 2)
    shape = Shape(1, 2, 256, 80)
    useful = fv.attention_flops(1, 256, 80, True, "bwd", heads=2)
    row = fv.backward_breakdown(shape, 2.0, "two_pass", ceiling_tflops=1.0)
    assert row["products"] == 7 and row["useful_tflops"] == pytest.approx(useful / 2e-3 / 1e12)
    # 7 products instead of 5, on 128-wide tiles for d = 80
    assert row["executed_tflops"] == pytest.approx(row["useful_tflops"] * 7 / 5 * 128 / 80)
    assert row["of_ceiling"] == pytest.approx(row["executed_tflops"])
    # split into 64 + 16 columns: the products run on 80 columns, none padded
    assert fv.backward_breakdown(shape, 2.0, "fused", 1.0, columns=80)["executed_tflops"] == pytest.approx(
        row["useful_tflops"] * 7 / 5)
    assert fv.executed_flops(shape, "fwd", columns=80) == pytest.approx(fv.attention_flops(1, 256, 80, True, "fwd",
                                                                                           heads=2))


def test_best_variants_prefers_graph_times_and_skips_wrong_results():
    rows = pd.DataFrame([
        dict(shape="s", dtype="bf16", impl="triton", variant="default", status="ok", ok=True, fwd_tflops=10.0,
             bwd_tflops=5.0, e2e_tflops=6.0, fwd_graph_tflops=20.0, bwd_graph_tflops=9.0, e2e_graph_tflops=11.0),
        dict(shape="s", dtype="bf16", impl="triton", variant="fast", status="ok", ok=True, bwd_tflops=8.0,
             bwd_graph_tflops=12.0),
        dict(shape="s", dtype="bf16", impl="triton", variant="wrong", status="ok", ok=False, bwd_tflops=99.0,
             bwd_graph_tflops=99.0),
        dict(shape="s", dtype="bf16", impl="sdpa", variant="sdpa", status="ok", fwd_tflops=1.0, bwd_tflops=1.0,
             e2e_tflops=1.0, fwd_graph_tflops=30.0, bwd_graph_tflops=10.0, e2e_graph_tflops=12.0),
    ])
    best = fv.best_variants(rows).iloc[0]
    assert best["timing"] == "graph" and best["best_bwd"] == "fast" and best["best_bwd_tflops"] == 12.0
    assert best["best_fwd"] == "default" and best["sdpa_bwd_tflops"] == 10.0 and best["default_e2e_tflops"] == 11.0


def test_sweep_shape_checks_every_variant_on_cpu():
    """Interpreted kernels on a tiny ragged shape: the variants and SDPA agree with fp32 SDPA within the bf16
    tolerance, rows carry the resolved plan, and an implementation that cannot run (SDPA's cuDNN backend on a
    CPU) is a row with its reason."""
    variants = {n: (c, ()) for n, (c, _) in fv.sweep_configs().items() if n in ("default", "fused 64x64 w4 s3")}
    seen = []
    df = fv.sweep_shape(Shape(1, 2, 40, 24), "bf16", variants, peers=("sdpa", "sdpa_cudnn"), device="cpu",
                        sink=seen.append)
    assert len(seen) == len(df) == len(variants) + 2
    ok = df[df["status"] == "ok"]
    assert len(ok) == len(variants) + 1
    assert ok["ok"].all() and (ok["rel_err"] < fv.TOLERANCE["bf16"]).all() and (ok["rel_err"] > 0).all()
    assert "fused" in set(df.loc[df["impl"] == "triton", "bwd_mode"])
    # interpreted: the portable kernels, both ways, and the rows say so
    assert (df.loc[df["impl"] == "triton", ["kernel", "bwd_kernel"]] == "triton").all().all()
    failed = df.set_index("variant").loc["sdpa_cudnn"]
    assert failed["status"] == "error" and failed["note"]


def test_host_attention_inline_variant_matches_the_registry():
    """``flash_triton_inline`` and ``flash_triton_opaque`` compute what the registry's ``flash_triton`` computes, to
    the bit (the same kernels); other names are the registry's functions."""
    from lab.model.attention import get_attention

    assert fv.host_attention("sdpa") is get_attention("sdpa")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    got = fv.host_attention("flash_triton_inline")(q, k, v, True)
    torch.testing.assert_close(got, get_attention("flash_triton")(q, k, v, True), atol=0, rtol=0)
    torch.testing.assert_close(fv.host_attention("flash_triton_opaque")(q, k, v, True), got, atol=0, rtol=0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_kernel_columns_follow_the_split_the_measuring_device_made():
    """d = 80 in bf16: a GPU's forward runs 64 + 16 columns at every length, its backward only on long sequences;
    the interpreter (rows measured on the CPU) never splits; a recorded count wins."""
    gpu = dict(dtype="bf16", d=80, gpu="NVIDIA H100 80GB HBM3")
    assert fv.kernel_columns(dict(gpu, seq_len=512), "fwd") == 80
    assert fv.kernel_columns(dict(gpu, seq_len=512), "bwd") == 128
    assert fv.kernel_columns(dict(gpu, seq_len=4096), "bwd") == 80
    assert fv.kernel_columns(dict(gpu, seq_len=4096, fwd_columns=128), "fwd") == 128
    assert fv.kernel_columns(dict(gpu, seq_len=4096, gpu="cpu"), "fwd") == 128
    assert fv.kernel_columns(dict(d=80), "fwd") == 128  # nothing to tell: one masked tile


def test_course_timing_test_on_the_cpu():
    """The course's test runs interpreted on a tiny shape, with enough samples for a verdict, and says where it
    ran (its goal is an H100's)."""
    row = fv.course_timing_table((False,), batch=1, seq=32, d=16, device="cpu", cpu_steps=5).iloc[0]
    assert row["gpu"] == "cpu" and row["fwdbwd_n"] == 5 and row["fwdbwd_ms"] > 0 and not row["compiled"]
    assert row["fwdbwd_spread_ms"] >= 0
