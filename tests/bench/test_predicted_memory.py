"""lab.bench.predicted_memory: the closed forms of lab.accounting against measured peaks and against what
autograd really saves."""

import pandas as pd
import pytest

from lab import accounting as acc
from lab.bench.predicted_memory import predicted_vs_measured, saved_activations_check
from lab.model.transformer import ModelConfig, config_for

TINY = dict(d_model=24, d_ff=56, num_layers=2, num_heads=3, context_length=16, vocab_size=50)


def test_predicted_vs_measured_rows():
    nan = float("nan")
    lm_step = pd.DataFrame([
        dict(size="small", context=128, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1,
             fwd_ms=nan, fwdbwd_ms=nan, step_ms=3.0, fwd_peak_gib=nan, fwdbwd_peak_gib=nan, step_peak_gib=3.0,
             status="ok"),
        dict(size="small", context=128, batch=4, dtype="bf16", attention="sdpa", compile=False, world_size=1,
             fwd_ms=1.0, fwdbwd_ms=nan, step_ms=nan, fwd_peak_gib=1.0, fwdbwd_peak_gib=nan, step_peak_gib=nan,
             status="ok"),
        # a mode that ran out of memory has no time and no peak: no comparison for it, the others stay
        dict(size="10B", context=2048, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1,
             fwd_ms=2.0, fwdbwd_ms=nan, step_ms=nan, fwd_peak_gib=nan, fwdbwd_peak_gib=nan, step_peak_gib=nan,
             status="oom"),
        dict(size="tiny", context=32, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1,
             fwd_ms=1.0, fwdbwd_ms=nan, step_ms=nan, fwd_peak_gib=nan, fwdbwd_peak_gib=nan, step_peak_gib=nan,
             status="ok"),
    ])
    sharding = pd.DataFrame([
        dict(impl="ddp", world_size=2, size="small", context=128, batch=4, dtype="fp32", peak_init_gib=0.5,
             peak_before_step_gib=2.0, peak_after_step_gib=2.5, status="ok", gpu="NVIDIA H200", commit="abc"),
        dict(impl="fsdp", world_size=2, size="small", context=128, batch=4, dtype="fp32", peak_init_gib=0.3,
             peak_before_step_gib=1.5, peak_after_step_gib=1.2, status="ok"),
    ])
    out = predicted_vs_measured(lm_step, sharding)
    assert list(out["table"]) == ["lm_step", "lm_step", "sharding_benchmark", "sharding_benchmark"]
    assert (out.iloc[2].gpu, out.iloc[2].commit) == ("NVIDIA H200", "abc")  # who measured the row, kept beside it
    cfg = config_for("small", context_length=128)
    step = acc.training_memory(cfg, 4, 128, "fp32", "train_step")
    assert out.iloc[0].impl == "train_step"
    assert out.iloc[0].predicted_gib == pytest.approx(step["peak"] / 2**30)  # gradients dropped before forward
    assert out.iloc[0].ratio == pytest.approx(3.0 / (step["peak"] / 2**30))
    fwd = acc.training_memory(cfg, 4, 128, "bf16_autocast", "forward")
    assert out.iloc[1].impl == "forward" and out.iloc[1].predicted_gib == pytest.approx(fwd["peak"] / 2**30)
    # DDP: only the measured maximum matters; FSDP divides params, grads, optimizer (and copies) by 2
    assert out.iloc[2].measured_gib == 2.5 and out.iloc[2].predicted_gib == pytest.approx(step["total"] / 2**30)
    # plus the gathered fp32 weights of two blocks in flight: 2 x (4 x 768^2 + 3 x 768 x 3072) x 4 B
    in_flight = 2 * (4 * 768**2 + 3 * 768 * 3072) * 4
    fsdp = (step["params"] + step["grads"] + step["optimizer"]) / 2 + step["activations"] + in_flight
    assert out.iloc[3].predicted_gib == pytest.approx(fsdp / 2**30)
    assert predicted_vs_measured(None, None).empty


def test_saved_activations_check_agrees_with_lab_saved_tensors():
    table = saved_activations_check({"tiny": ModelConfig(**TINY)}, batch=3, context=12)
    assert len(table) == 6
    assert table.match.all(), table
    # the fp32 SDPA row by hand: blocks 2 x 36 tokens x 1,972 B = 141,984; head 36 x 508 + 4 = 18,292;
    # RoPE tables 2 blocks x 12 positions x 8 (head_dim) x 4 B = 768
    row = table[(table.attention == "sdpa") & (table.precision == "fp32")].iloc[0]
    assert row.measured_bytes == 141_984 + 18_292 + 768
