import math

import pandas as pd
import pytest
import torch

from lab.bench.lm import profile_lm
from lab.measure import profiling
from lab.model.transformer import ModelConfig
from tests.kineto import write_trace

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


def test_phase_breakdown_names_the_largest_other_kernels(tmp_path):
    # forward: a GEMM, an RMSNorm and two copies; backward: an attention kernel, a copy, an NCCL reduce-scatter
    ranges = (("forward", 0, 1000), ("backward", 1000, 1000), ("optimizer_step", 2000, 100))
    kernels = [("sm90_xmma_gemm_bf16", 100, 300, 7, 10), ("triton_red_fused_rms_norm", 400, 50, 7, 20),
               ("copy_kernel", 450, 20, 7, 30), ("copy_kernel", 470, 10, 7, 40),
               ("x" * 80 + "_a", 480, 4, 7, 45), ("x" * 80 + "_b", 490, 4, 7, 46),
               ("flash_bwd_kernel", 1100, 200, 7, 1010), ("copy_kernel", 1300, 30, 7, 1020),
               ("ncclDevKernel_ReduceScatter", 1300, 100, 20, 1030), ("multi_tensor_apply_kernel", 2000, 40, 7, 2010)]
    path = write_trace(tmp_path / "trace.json", ranges, [(*k, 1) for k in kernels])
    out = profiling.phase_breakdown(path)
    assert out["matmul_ms"] == pytest.approx(0.3) and out["attention_ms"] == pytest.approx(0.2)
    assert out["optimizer_ms"] == pytest.approx(0.04)
    assert out["other_kernels_ms"] == pytest.approx(0.118)  # 50 + 20 + 10 + 30 + 4 + 4 us
    # two kernels whose names agree in their first 80 characters are one entry
    assert out["other_kernels_top"] == "copy_kernel=0.06; triton_red_fused_rms_norm=0.05; " + "x" * 80 + "=0.008"
    # the reduce-scatter runs 1300-1400 us, a copy beside it until 1330: 70 us exposed; no kernel at all runs in
    # 484-490, 494-1100, 1400-2000 us of the 100-2040 us window
    assert out["exposed_communication_ms"] == pytest.approx(0.07)
    assert out["idle_ms"] == pytest.approx((6 + 606 + 600) / 1000)
    assert profiling.phase_breakdown(write_trace(tmp_path / "empty.json", (), ()))["other_kernels_top"] == ""


def test_kernel_phases_by_name_and_launch_range():
    assert profiling.kernel_phase("_lse_kernel", "forward") == "loss"
    assert profiling.kernel_phase("_dlogits_kernel", "backward") == "loss"
    log_softmax = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, "
                   "c10::BFloat16, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>")
    assert profiling.kernel_phase(log_softmax, "") == "loss"
    assert profiling.kernel_phase("nll_loss_forward_reduce_cuda_kernel_2d", "forward") == "loss"
    assert profiling.kernel_phase("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "forward") == "attention"
    assert profiling.kernel_phase("_lse_kernel", "recompute") == "recompute"
    assert profiling.kernel_phase("ncclDevKernel_AllGather_RING_LL", "forward") == "communication"
    assert profiling.kernel_phase("multi_tensor_apply_kernel", "optimizer_step") == "optimizer"
    fused_adam = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>"
    assert profiling.kernel_phase(fused_adam, "backward") == "optimizer"  # an update stepped inside the backward
    add = "void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>"
    assert profiling.kernel_phase(add, "") == "other_kernels"


def test_phase_gaps_subtract_the_reference_row_of_each_group():
    cols = dict.fromkeys(profiling.PHASE_COLUMNS, 0.0)
    rows = pd.DataFrame([
        dict(cols, config="a", impl="one", step_ms=90.0, matmul_ms=30.0, idle_ms=40.0),
        dict(cols, config="a", impl="ddp", step_ms=125.0, matmul_ms=32.5, idle_ms=62.5,
             exposed_communication_ms=17.0, other_kernels_ms=10.0),
        dict(cols, config="b", impl="ddp", step_ms=300.0, matmul_ms=99.0),  # no reference row in its group
        dict({c: math.nan for c in cols}, config="a", impl="cpu", step_ms=95.0)])  # nothing profiled
    gaps = profiling.phase_gaps(rows, "one")
    assert list(gaps["impl"]) == ["ddp"] and list(gaps["config"]) == ["a"]
    row = gaps.iloc[0]
    assert row["matmul_ms"] == pytest.approx(2.5) and row["idle_ms"] == pytest.approx(22.5)
    assert row["exposed_communication_ms"] == pytest.approx(17.0) and row["optimizer_ms"] == 0.0
    assert row["profiled_gap_ms"] == pytest.approx(2.5 + 22.5 + 17.0 + 10.0)
    assert row["step_gap_ms"] == pytest.approx(35.0)
    assert profiling.phase_gaps(rows.drop(columns=profiling.PHASE_COLUMNS), "one").empty
