import math

import pandas as pd
import pytest
import torch

from lab.bench.lm import profile_lm
from lab.measure import profiling
from lab.model.transformer import ModelConfig

CFG = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=64)


@pytest.mark.parametrize("name,expected", [
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "matmul"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_16x4_tn_align4>", "matmul"),
    ("aten::mm", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>", "other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "other"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "fused attention"),
    ("_attn_fwd", "fused attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "fused attention"),  # attention although CUTLASS-built
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "loss"),
    ("_lse_kernel", "loss"),
    ("_matmul_kernel", "matmul"),  # the fused loss's gradient products
    ("ncclDevKernel_AllGather_RING_LL", "communication"),
])
def test_kernel_class(name, expected):
    assert profiling.kernel_class(name) == expected


def test_profile_tables_on_cpu(tmp_path):
    prof = profile_lm(CFG, mode="forward_backward", context=16, batch=2, attention="naive",
                                device="cpu", warmup=1, steps=2, trace_path=tmp_path / "t.json")
    assert (tmp_path / "t.json").stat().st_size > 1000
    table = profiling.kernel_table(prof, top=None)
    assert table["share"].sum() == pytest.approx(1.0)
    mm = table[table["name"] == "aten::mm"]
    # 2 blocks x (4 attention + 3 ffn projections) + head = 15 forward matmuls; backward adds ~2 per matmul
    assert mm["calls_per_step"].iloc[0] >= 15
    shares = profiling.class_shares(prof)
    assert set(shares["class"]) >= {"matmul", "other"} and shares["share"].sum() == pytest.approx(1.0)
    two = profiling.class_shares(pd.concat([table.assign(mode="a"), table.assign(mode="b")]), by=("mode",))
    assert list(dict.fromkeys(two["mode"])) == ["a", "b"] and two.groupby("mode")["share"].sum().tolist() == \
        pytest.approx([1.0, 1.0])
    assert two[two["mode"] == "a"].set_index("class")["share"].to_dict() == pytest.approx(
        shares.set_index("class")["share"].to_dict())
    ranges = profiling.range_times(prof).set_index("range")
    assert (ranges["calls_per_step"] == CFG.num_layers).all() and (ranges["ms_per_step"] > 0).all()
    assert profiling.step_wall_ms(prof) > 0


def test_attention_phase_flops():
    f = profiling.attention_phase_flops(batch=2, heads=3, seq=4, head_dim=8)
    scores = 2 * 3 * 4 * 4
    assert f["attention/final_matmul"] == 2 * scores * 8
    assert f["attention/scores"] == 2 * scores * 8 + scores
    assert f["attention/softmax"] == 5 * scores




def test_step_wall_time_is_the_cpu_range_not_its_gpu_mirror():
    """The GPU mirror of a ``step i`` range may come in pieces (H100: 139 ms "wall" against 324 ms of kernels);
    the wall time is the CPU range, which ends after the in-range synchronize."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device, start, end):
        span = SimpleNamespace(elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    events = [event("step 0", DeviceType.CPU, 0, 300_000), event("step 1", DeviceType.CPU, 400_000, 700_000),
              event("step 0", DeviceType.CUDA, 10_000, 90_000), event("step 0", DeviceType.CUDA, 100_000, 290_000),
              event("step 1", DeviceType.CUDA, 410_000, 500_000), event("step 1", DeviceType.CUDA, 510_000, 690_000)]
    prof = SimpleNamespace(events=lambda: events)
    assert profiling.step_wall_ms(prof) == pytest.approx(300.0)


def test_gpu_kernel_ms_is_nan_off_cuda():
    assert math.isnan(profiling.gpu_kernel_ms(lambda: None, torch.device("cpu")))
    assert all(math.isnan(x) for x in profiling.gpu_kernel_times(lambda: None, torch.device("cpu")).values())


def test_kernel_times_count_concurrent_kernels_once_and_leave_the_collectives_out_of_compute():
    ms = 1_000_000  # spans in ns
    spans = [(0, 4 * ms, "sm90_gemm"), (1 * ms, 2 * ms, "triton_poi_fused"),  # nested: once
             (3 * ms, 7 * ms, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"), (8 * ms, 9 * ms, "Memcpy DtoD")]
    assert profiling.kernel_times(spans) == {"gpu_ms": pytest.approx(8.0), "compute_ms": pytest.approx(5.0)}
    assert profiling.kernel_times([]) is None
