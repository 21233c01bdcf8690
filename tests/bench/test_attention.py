"""Tests for lab.bench.attention: FLOP and memory closed forms against counts, the grid runners' rows."""

import gc
import importlib.util
import math
import weakref

import pandas as pd
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab.bench import attention as ab
from lab.model.attention import naive_attention as model_naive_attention

# ---------------------------------------------------------------------------------------------------------
# FLOPs


def test_attention_pairs_by_hand():
    assert ab.attention_pairs(4) == 16
    assert ab.attention_pairs(4, causal=True) == 4 + 3 + 2 + 1
    # top-left aligned causal mask (as SDPA): query 0 sees key 0, query 1 keys 0..1
    assert ab.attention_pairs(2, 4, causal=True) == 1 + 2
    # more queries than keys: the later queries see every key
    assert ab.attention_pairs(4, 2, causal=True) == 1 + 2 + 2 + 2
    with pytest.raises(ValueError):
        ab.attention_pairs(0)


def test_attention_flops_by_hand():
    # batch 2, seq 4, d 8: forward 2 matmuls x 2 FLOPs x 2*16 pairs x 8 = 1024
    assert ab.attention_flops(2, 4, 8) == 1024
    assert ab.attention_flops(2, 4, 8, causal=True) == 4 * 2 * 10 * 8
    assert ab.attention_flops(2, 4, 8, causal=True, pass_="bwd") == 2.5 * 640
    assert ab.attention_flops(2, 4, 8, causal=True, pass_="e2e") == 3.5 * 640
    assert ab.attention_flops(1, 4, 8, heads=2) == ab.attention_flops(2, 4, 8)
    # large causal: the papers' s^2/2 rounding is off by 1/s
    s = 65536
    assert ab.attention_flops(1, s, 128, True) / (4 * s * s * 128 / 2) == pytest.approx(1 + 1 / s)
    with pytest.raises(ValueError):
        ab.attention_flops(1, 4, 8, pass_="backward")


def test_attention_flops_match_torch_flop_counter():
    """Non-causal naive attention: forward is exactly 4*b*s^2*d; its backward (no recomputation) does the
    four gradient matmuls, 8*b*s^2*d, i.e. our backward count minus the recomputed Q K^T."""
    b, s, d = 2, 24, 16
    q, k, v = (torch.randn(b, s, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as fwd_counter:
        out = model_naive_attention(q, k, v, False)
    with FlopCounterMode(display=False) as bwd_counter:
        out.sum().backward()
    assert fwd_counter.get_total_flops() == ab.attention_flops(b, s, d, False, "fwd")
    recompute = 2 * b * s * s * d
    assert bwd_counter.get_total_flops() == ab.attention_flops(b, s, d, False, "bwd") - recompute


def test_naive_attention_matches_model_and_sdpa_in_float64():
    q, k, v = (torch.randn(3, 20, 8, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        ours = ab.attention_impl("pytorch_naive", "cpu")(q, k, v, causal)
        torch.testing.assert_close(ours, model_naive_attention(q, k, v, causal))
        sdpa = ab.attention_impl("sdpa", "cpu")
        torch.testing.assert_close(sdpa(q, k, v, causal),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        torch.testing.assert_close(ours, sdpa(q, k, v, causal))


def test_errors_vs_float64():
    def off_by_one_percent(q, k, v, causal):
        return model_naive_attention(q, k, v, causal) * 1.01

    errs = ab.errors_vs_float64({"sdpa": ab.attention_impl("sdpa", "cpu"), "scaled": off_by_one_percent}, batch=2, seq=32, d=16,
                                device="cpu").set_index("impl")
    assert (errs.loc["sdpa", ["out", "dq", "dk", "dv"]] < 1e-5).all()
    # a 1% scaled output: the output error is 1% of the largest |output|, and dV (linear in the output
    # scale) is off by 1% of the largest |dV|
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 32, 16, generator=gen).double() for _ in range(4))
    v.requires_grad_()
    ref = model_naive_attention(q, k, v, True)
    (dv,) = torch.autograd.grad(ref, (v,), do)
    assert errs.loc["scaled", "out"] == pytest.approx(0.01 * ref.abs().max().item(), rel=1e-3)
    assert errs.loc["scaled", "dv"] == pytest.approx(0.01 * dv.abs().max().item(), rel=1e-3)


# ---------------------------------------------------------------------------------------------------------
# Memory


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_saved_bytes_closed_form_matches_autograd(dtype, causal):
    b, s, d = 3, 40, 8
    q, k, v = (torch.randn(b, s, d, dtype=ab.DTYPES[dtype], requires_grad=True) for _ in range(3))
    measured = ab.saved_tensor_bytes(lambda x, y, z: model_naive_attention(x, y, z, causal), q, k, v)
    e = 4 if dtype == "fp32" else 2
    closed = b * s * s * e + (s * s if causal else 0)
    assert measured == closed == ab.naive_attention_totals(b, s, d, dtype, causal)["saved"]


def test_saved_tensor_bytes_frees_the_graph():
    """Counting must not keep what it counts alive (a leak here polluted every later memory reading)."""
    refs = []

    def attention_keeping_a_weakref(q, k, v):
        probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        refs.append(weakref.ref(probs))
        return probs @ v

    q, k, v = (torch.randn(2, 64, 8, requires_grad=True) for _ in range(3))
    assert ab.saved_tensor_bytes(attention_keeping_a_weakref, q, k, v) == 2 * 64 * 64 * 4
    gc.collect()
    assert refs[0]() is None


def test_naive_memory_terms_by_hand():
    # batch 8, seq 16384, fp32: P alone is 8 * 16384^2 * 4 B = 8 GiB
    t = ab.naive_attention_memory(8, 16384, 64, "fp32")
    assert t.set_index("term").loc["probabilities P (saved)", "bytes"] == 8 * 2**30
    totals = ab.naive_attention_totals(8, 16384, 64, "fp32")
    qkv_do_out = 5 * 8 * 16384 * 64 * 4
    assert totals["before_backward"] == 8 * 2**30 + qkv_do_out
    assert totals["peak"] == 3 * 8 * 2**30 + qkv_do_out
    causal = ab.naive_attention_totals(8, 16384, 64, "fp32", causal=True)
    assert causal["saved"] == 8 * 2**30 + 16384**2


def test_naive_memory_check_subtracts_the_baseline():
    row = pd.Series(dict(predicted_saved_mib=8.0, saved_mib=8.0, predicted_before_bwd_mib=10.0,
                         mem_before_bwd_mib=42.0, mem_baseline_mib=32.0, predicted_peak_mib=20.0, peak_mib=62.0))
    check = ab.naive_memory_check(row)
    assert check["measured_mib"].tolist() == [8.0, 10.0, 30.0]
    assert check["measured_over_predicted"].tolist() == [1.0, 1.0, 1.5]


def test_flash_saved_bytes_closed_form():
    assert ab.flash_attention_saved_bytes(2, 16, 8, "bf16", heads=3) == 4 * 6 * 16 * 8 * 2 + 6 * 16 * 4


@pytest.mark.skipif(importlib.util.find_spec("lab.kernels.flash_pytorch") is None, reason="lab.kernels.flash_pytorch not written yet")
def test_flash_pytorch_saves_what_the_closed_form_says():
    from lab.kernels.flash_pytorch import FlashAttentionPytorch

    b, s, d = 2, 64, 16
    q, k, v = (torch.randn(b, s, d, requires_grad=True) for _ in range(3))
    measured = ab.saved_tensor_bytes(lambda x, y, z: FlashAttentionPytorch.apply(x, y, z, True), q, k, v,
                                     exclude_inputs=False)
    assert measured == ab.flash_attention_saved_bytes(b, s, d, "fp32")


def test_fit_power_law():
    x = [256, 1024, 4096]
    p, c = ab.fit_power_law(x, [3.0 * v**2 for v in x])
    assert p == pytest.approx(2.0) and c == pytest.approx(3.0)
    with pytest.raises(ValueError):
        ab.fit_power_law([1], [1])


# ---------------------------------------------------------------------------------------------------------
# The naive grid


def test_naive_grid_rows_and_memory():
    df = ab.run_naive_grid(ds=(8, 16), seqs=(16, 32), batch=2, passes=2, warmup=0, device="cpu", progress=False)
    assert len(df) == 4
    assert list(zip(df["d"], df["seq_len"])) == [(8, 16), (8, 32), (16, 16), (16, 32)]
    for col in ["impl", "compile", "fwd_ms", "bwd_ms", "mem_before_bwd_mib", "saved_mib", "predicted_saved_mib",
                "status", "note"]:
        assert col in df.columns
    assert (df["status"] == "ok").all() and (df["impl"] == "naive_attention").all()
    assert (df["fwd_ms"] > 0).all() and (df["bwd_ms"] > 0).all()
    # what autograd saved equals the closed form, per configuration
    assert (df["saved_mib"] == df["predicted_saved_mib"]).all()
    assert df.loc[1, "saved_mib"] * 2**20 == 2 * 32 * 32 * 4
    scaling = ab.saved_memory_scaling(df)
    assert scaling["p_all"].tolist() == pytest.approx([2.0, 2.0])
    row, kind = ab.accounting_config(df)
    assert kind == "largest_fit" and row["seq_len"] == 32 and row["d"] == 16


def test_naive_grid_records_oom_rows():
    def always_oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    df = ab.run_naive_grid(always_oom, ds=(8,), seqs=(16, 32), batch=1, passes=1, warmup=0, device="cpu",
                           progress=False)
    assert (df["status"] == "oom").all()
    assert df["note"].str.contains("forward").all() and df["fwd_ms"].isna().all()
    row, kind = ab.accounting_config(df)
    assert kind == "oom" and row["seq_len"] == 16

    class OomInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q * 2

        @staticmethod
        def backward(ctx, grad):
            raise torch.OutOfMemoryError("CUDA out of memory (backward)")

    df = ab.run_naive_grid(lambda q, k, v, causal: OomInBackward.apply(q) + k + v, ds=(8,), seqs=(16,), batch=1,
                           passes=2, warmup=0, device="cpu", impl="bwd_oom", progress=False)
    assert df.loc[0, "status"] == "oom" and "backward" in df.loc[0, "note"]
    assert df.loc[0, "fwd_ms"] > 0 and math.isnan(df.loc[0, "bwd_ms"])

    def other_error(q, k, v, causal):
        raise ValueError("a bug, not a memory problem")

    with pytest.raises(ValueError):
        ab.run_naive_grid(other_error, ds=(8,), seqs=(16,), passes=1, warmup=0, device="cpu", progress=False)


def test_eager_vs_compiled_table():
    eager = pd.DataFrame(dict(d=[16, 16], seq_len=[64, 128], fwd_ms=[2.0, 8.0], bwd_ms=[4.0, 16.0],
                              mem_before_bwd_mib=[1.0, 4.0], saved_mib=[1.0, 4.0], status=["ok", "ok"]))
    compiled = eager.assign(fwd_ms=[1.0, 2.0], bwd_ms=[4.0, 8.0], compile_s=[3.0, 3.0])
    t = ab.eager_vs_compiled(eager, compiled)
    assert t["fwd_speedup"].tolist() == [2.0, 4.0] and t["bwd_speedup"].tolist() == [1.0, 2.0]


@pytest.mark.slow
def test_compiled_grid_matches_eager_memory():
    df = ab.run_naive_grid(ds=(8,), seqs=(16,), batch=2, passes=2, warmup=1, compile=True, device="cpu",
                           progress=False)
    assert df.loc[0, "status"] == "ok" and bool(df.loc[0, "compile"])
    assert df.loc[0, "compile_s"] > 0 and df.loc[0, "fwd_ms"] > 0 and df.loc[0, "bwd_ms"] > 0


# ---------------------------------------------------------------------------------------------------------
# The flash grid and its tables


def test_flash_grid_rows_tflops_and_speedups():
    impls = {"pytorch_naive": ab.naive_attention, "sdpa": ab.attention_impl("sdpa", "cpu")}
    df = ab.run_flash_grid(impls, seqs=(32, 64), ds=(16,), dtypes=("fp32",), heads=2, cpu_steps=2,
                           device="cpu", progress=False)
    assert len(df) == 4 and (df["status"] == "ok").all()
    assert set(df["impl"]) == {"pytorch_naive", "sdpa"} and (df["heads"] == 2).all() and df["causal"].all()
    for p in ab.PASSES:
        assert (df[f"{p}_ms"] > 0).all()
    r = df.iloc[0]
    assert r["fwd_tflops"] == pytest.approx(4 * 2 * (32 * 33 / 2) * 16 / (r["fwd_ms"] * 1e-3) / 1e12)
    assert r["e2e_tflops"] == pytest.approx(14 * 2 * (32 * 33 / 2) * 16 / (r["e2e_ms"] * 1e-3) / 1e12)
    sp = ab.add_speedups(df)
    sdpa = sp[sp["impl"] == "sdpa"]
    assert sdpa["e2e_speedup_vs_sdpa"].tolist() == [1.0, 1.0]
    naive = sp[sp["impl"] == "pytorch_naive"].iloc[0]
    assert naive["fwd_speedup_vs_sdpa"] == pytest.approx(sdpa.iloc[0]["fwd_ms"] / naive["fwd_ms"])


def test_flash_grid_oom_rows():
    def oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory")

    df = ab.run_flash_grid({"broken": oom, "pytorch_naive": ab.naive_attention}, seqs=(16,), ds=(16,),
                           dtypes=("fp32",), cpu_steps=1, device="cpu", progress=False)
    broken = df[df["impl"] == "broken"].iloc[0]
    assert broken["status"] == "oom" and "forward" in broken["note"] and math.isnan(broken["fwd_tflops"])
    assert df[df["impl"] == "pytorch_naive"].iloc[0]["status"] == "ok"
    # a memory limit below the naive requirement: recorded as OOM without being attempted
    df = ab.run_flash_grid({"pytorch_naive": ab.naive_attention}, seqs=(64,), ds=(16,), dtypes=("fp32",),
                           cpu_steps=1, device="cpu", memory_limit_gib=1e-6, progress=False)
    assert df.loc[0, "status"] == "oom" and "not attempted" in df.loc[0, "note"]


def test_flash_goals_from_known_times():
    def row(impl, seq, d, fwd, bwd, e2e, dtype="bf16"):
        return dict(impl=impl, dtype=dtype, batch=1, heads=1, seq_len=seq, d=d, causal=True, fwd_ms=fwd,
                    bwd_ms=bwd, e2e_ms=e2e, status="ok")

    df = pd.DataFrame([
        row("sdpa", 8192, 64, 1.0, 2.0, 3.0), row("triton", 8192, 64, 0.9, 2.4, 3.4),  # all goals met
        row("sdpa", 16384, 128, 4.0, 8.0, 12.0), row("triton", 16384, 128, 5.0, 8.0, 12.0),  # fwd too slow
        row("sdpa", 4096, 64, 1.0, 1.0, 1.0), row("triton", 4096, 64, 9.0, 9.0, 9.0),  # too short: ignored
        row("sdpa", 8192, 32, 1.0, 1.0, 1.0), row("triton", 8192, 32, 9.0, 9.0, 9.0),  # d 32: ignored
        row("sdpa", 8192, 64, 1.0, 1.0, 1.0, "fp32"), row("triton", 8192, 64, 9.0, 9.0, 9.0, "fp32"),
    ])
    g = ab.flash_goals(df).sort_values("seq_len")
    assert g["seq_len"].tolist() == [8192, 16384]
    assert g["fwd_ratio"].tolist() == pytest.approx([1 / 0.9, 0.8])
    assert g["fwd_ok"].tolist() == [True, False] and g["bwd_ok"].tolist() == [True, True]
    assert g["e2e_ok"].tolist() == [True, True]
    s = ab.summarize_goals(g)
    assert s["configs"] == 2 and s["fwd"]["met"] == 1 and s["fwd"]["worst"] == pytest.approx(0.8)
    assert not s["all_met"]
    empty = ab.summarize_goals(ab.flash_goals(df[df["seq_len"] < 8192]))
    assert empty["configs"] == 0 and not empty["all_met"] and math.isnan(empty["e2e"]["worst"])


def test_attention_impl_names():
    assert ab.attention_impl("pytorch_naive", "cpu") is ab.naive_attention
    with pytest.raises(ValueError):
        ab.attention_impl("flash3", "cpu")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lab.kernels.flash_triton") is None, reason="lab.kernels.flash_triton not written yet")
def test_flash_grid_runs_interpreted_triton():
    df = ab.run_flash_grid(("triton", "sdpa"), seqs=(32,), ds=(16,), dtypes=("fp32",), cpu_steps=1,
                           device="cpu", progress=False)
    assert (df["status"] == "ok").all() and (df["e2e_ms"] > 0).all()


# ---------------------------------------------------------------------------------------------------------
# LM rows


