"""The CPU memory estimate never under-counts a real step, and its advice names a change that fits."""

import pytest

from lab.bench.memory_estimate import HEADROOM, cpu_peak_bytes, fit_advice, measured_cpu_peak_bytes
from lab.model import config_for

GiB = 2**30


@pytest.mark.parametrize("attention,dtype", [("sdpa", "fp32"), ("sdpa", "bf16"), ("naive", "fp32"), ("naive", "bf16")])
@pytest.mark.parametrize("mode", ["forward", "forward_backward", "train_step"])
def test_estimate_covers_the_measured_peak(attention, dtype, mode):
    cfg = config_for("tiny", context_length=128, attention=attention)
    measured = measured_cpu_peak_bytes(cfg, 2, 128, dtype, mode)
    estimate = cpu_peak_bytes(cfg, 2, 128, dtype, mode)
    assert measured <= estimate <= 1.35 * measured, (measured / 2**20, estimate / 2**20)


def test_estimate_grows_with_context_as_the_measurement_does():
    cfg = config_for("tiny", context_length=256)
    measured = [measured_cpu_peak_bytes(cfg, 1, t, "fp32", "forward_backward") for t in (64, 256)]
    estimate = [cpu_peak_bytes(cfg, 1, t, "fp32", "forward_backward") for t in (64, 256)]
    slope_measured = (measured[1] - measured[0]) / 192
    slope_estimate = (estimate[1] - estimate[0]) / 192
    assert slope_measured <= slope_estimate <= 1.1 * slope_measured


def test_naive_attention_adds_the_quadratic_scores():
    sdpa, naive = (config_for("tiny", context_length=4096, attention=a) for a in ("sdpa", "naive"))
    extra = cpu_peak_bytes(naive, 1, 4096, "fp32", "forward_backward") - cpu_peak_bytes(sdpa, 1, 4096, "fp32",
                                                                                        "forward_backward")
    heads_scores = naive.num_heads * 4096 * 4096 * 4  # one fp32 score matrix per head
    assert extra >= 3 * heads_scores


def test_advice_names_the_largest_context_and_batch_that_fit():
    cfg = config_for("tiny", context_length=100_000)
    available = 8 * GiB
    advice = fit_advice("tiny", cfg, 4, 100_000, "fp32", ["forward_backward"], available)
    assert not advice.fits and advice.need > HEADROOM * available
    t = advice.max_context
    assert 0 < t < 100_000
    assert cpu_peak_bytes(cfg, 4, t, "fp32", "forward_backward") <= HEADROOM * available
    assert cpu_peak_bytes(cfg, 4, t + 1, "fp32", "forward_backward") > HEADROOM * available
    assert advice.smaller_sizes == ()  # tiny is the smallest: only a shorter context or smaller batch helps
    assert f"--context {t}" in advice.change()


def test_advice_offers_smaller_sizes_that_fit():
    cfg = config_for("10B", context_length=512)
    advice = fit_advice("10B", cfg, 4, 512, "fp32", ["train_step"], 64 * GiB)
    assert not advice.fits and advice.max_context == 0 and advice.max_batch == 0
    assert advice.smaller_sizes and "10B" not in advice.smaller_sizes
    for size in advice.smaller_sizes:
        small = config_for(size, context_length=512)
        assert cpu_peak_bytes(small, 4, 512, "fp32", "train_step") <= HEADROOM * 64 * GiB
