"""lab.bench.profiles: profiles are taken on first use only, and the tables of a real toy profile."""

from functools import partial

from lab.bench.lm import profile_lm
from lab.bench.profiles import KernelProfiles
from lab.model import ModelConfig


def test_kernel_profiles_are_taken_on_first_use_only(tmp_path):
    calls = []
    fake = lambda size, **kw: calls.append((size, kw["mode"], kw["trace_path"].name)) or object()
    profiles = KernelProfiles(fake, "mini", 64, 4, tmp_path)
    assert calls == []  # a replayed notebook builds the object but never asks for a table
    first = profiles.profiler("forward")
    assert profiles.profiler("forward") is first and calls == [("mini", "forward", "01_mini_forward.json")]


def test_kernel_profiles_of_a_toy_model(tmp_path):
    cfg = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=2, context_length=16, vocab_size=64)
    profiles = KernelProfiles(partial(profile_lm, device="cpu", warmup=1, steps=1), cfg, 16, 2, tmp_path)
    kernels = profiles.kernels()
    assert list(dict.fromkeys(kernels["mode"])) == ["forward", "forward_backward", "train_step"]
    assert (kernels["timeline"] == "cpu op").all() and (kernels["class"] == "matmul").any()
    steps = profiles.step_times()
    assert (steps["wall_ms"] > 0).all() and (steps["busy_ms"] == 0).all() and steps["size"].iloc[0] == "d32_L1"
    ranges = profiles.attention_ranges()
    assert ranges["range"].tolist() == ["attention/scores", "attention/softmax", "attention/final_matmul"]
    assert (ranges["gflop_per_step"] > 0).all() and (ranges["calls_per_step"] == 1).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_d32_L1_forward.json", "01_d32_L1_forward_backward.json",
                                                          "01_d32_L1_train_step.json"]
