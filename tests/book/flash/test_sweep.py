"""lab.book.flash.sweep: the variant sweep's parsing, variants, error and time accounting, and a check of
every variant on the CPU (interpreted kernels)."""

import pandas as pd
import pytest
import torch

from lab.book.flash import host
from lab.book.flash import sweep as fs


def test_parse_shape_and_its_errors():
    assert fs.parse_shape("4x32x512x80") == (fs.Shape(4, 32, 512, 80, True), "bf16")
    assert fs.parse_shape("2x16x4096x64:fp16:full") == (fs.Shape(2, 16, 4096, 64, False), "fp16")
    for bad in ("4x32x512", "4x32x512x80:int8", "axbxcxd"):
        with pytest.raises(ValueError, match="bad shape"):
            fs.parse_shape(bad)


def test_a_sweep_can_time_only_the_named_variants():
    variants = fs.sweep_configs()
    picked = fs.select_variants(variants, ["two_pass 64x128 w8 s3", "default"])
    assert list(picked) == ["default", "two_pass 64x128 w8 s3"]  # the sweep's order
    assert picked["two_pass 64x128 w8 s3"][0].backward_launch == "two_pass"
    assert fs.select_variants(variants, None) is variants and fs.select_variants(variants, []) is variants
    with pytest.raises(ValueError, match="unknown variant.*'two_pass 1x1'.*the sweep has: default"):
        fs.select_variants(variants, ["two_pass 1x1"])


def test_sweep_configs_cover_every_launch_mode_and_pass():
    variants = fs.sweep_configs()
    assert variants["default"][1] == fs.PASSES
    modes = {cfg.backward_launch for cfg, passes in variants.values() if passes == ("bwd",)}
    assert modes == {"fused", "two_pass"} == set(fs.PRODUCTS)
    fwd = [cfg for cfg, passes in variants.values() if passes == ("fwd",)]
    assert len(fwd) == len(fs.SWEEP_FWD_TILES) + len(fs.SWEEP_FWD) and all(len(cfg.fwd_tiles) == 4 for cfg in fwd)


def test_relative_errors_and_backward_breakdown():
    ref = [torch.tensor([1.0, -4.0]), torch.tensor([2.0, 0.0])]
    got = [torch.tensor([1.0, -3.6]), torch.tensor([2.0, 0.1])]
    assert fs.relative_errors(got, ref) == pytest.approx(0.1)  # max(0.4 / 4, 0.1 / 2)
    shape = fs.Shape(1, 2, 256, 80)
    useful = fs.attention_flops(1, 256, 80, True, "bwd", heads=2)
    row = fs.backward_breakdown(shape, 2.0, "two_pass", ceiling_tflops=1.0)
    assert row["products"] == 7
    assert row["useful_tflops"] == pytest.approx(useful / 2e-3 / 1e12)
    # 7 products instead of 5, on 128-wide tiles for d = 80
    assert row["executed_tflops"] == pytest.approx(row["useful_tflops"] * 7 / 5 * 128 / 80)
    assert row["of_ceiling"] == pytest.approx(row["executed_tflops"])
    # split into 64 + 16 columns: the products run on 80 columns, none padded
    assert fs.backward_breakdown(shape, 2.0, "fused", 1.0, columns=80)["executed_tflops"] == pytest.approx(
        row["useful_tflops"] * 7 / 5)


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
    best = fs.best_variants(rows).iloc[0]
    assert best["timing"] == "graph" and best["best_bwd"] == "fast" and best["best_bwd_tflops"] == 12.0
    assert best["best_fwd"] == "default" and best["sdpa_bwd_tflops"] == 10.0 and best["default_e2e_tflops"] == 11.0


def test_sweep_shape_checks_every_variant_on_cpu():
    """Interpreted kernels on a tiny ragged shape: every variant and SDPA agree with fp32 SDPA within the
    bf16 tolerance (the interpreter runs bf16 in fp32, so the error is the output's rounding), rows carry
    the resolved plan, and an implementation that cannot run (SDPA's cuDNN backend on a CPU) is a row with
    its reason."""
    variants = {n: (c, ()) for n, (c, _) in fs.sweep_configs().items() if n == "default" or "two_pass" in n}
    seen = []
    df = fs.sweep_shape(fs.Shape(1, 2, 40, 24), "bf16", variants, peers=("sdpa", "sdpa_cudnn"), device="cpu",
                        sink=seen.append)
    assert len(seen) == len(df) == len(variants) + 2
    ok = df[df["status"] == "ok"]
    assert len(ok) == len(variants) + 1
    assert ok["ok"].all() and (ok["rel_err"] < fs.TOLERANCE["bf16"]).all() and (ok["rel_err"] > 0).all()
    assert set(df.loc[df["impl"] == "triton", "bwd_mode"]) == {"fused", "two_pass"}
    failed = df.set_index("variant").loc["sdpa_cudnn"]
    assert failed["status"] == "error" and failed["note"]


def test_host_attention_inline_variant_matches_the_registry():
    """``flash_triton_inline`` (the ops decomposed under torch.compile on a GPU) and ``flash_triton_opaque``
    compute what the registry's
    ``flash_triton`` computes, to the bit (the same kernels); other names are the registry's functions."""
    from lab.model.attention import get_attention

    assert host.host_attention("sdpa") is get_attention("sdpa")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    got = host.host_attention("flash_triton_inline")(q, k, v, True)
    torch.testing.assert_close(got, get_attention("flash_triton")(q, k, v, True), atol=0, rtol=0)
    torch.testing.assert_close(host.host_attention("flash_triton_opaque")(q, k, v, True), got, atol=0, rtol=0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
