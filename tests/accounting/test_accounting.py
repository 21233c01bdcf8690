"""Closed forms of lab.accounting against hand arithmetic, the real model and the ring simulator."""

import math

import numpy as np
import pytest
import sympy as sp
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab import accounting as acc
from lab.accounting.ring_sim import simulate
from lab.measure.step import lm_loss
from lab.model.transformer import MODEL_SIZES, ModelConfig, TransformerLM, config_for

TINY = dict(d_model=24, d_ff=56, num_layers=2, num_heads=3, context_length=16, vocab_size=50)


# ---------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("shape", [dict(d_model=8, d_ff=16, num_layers=1, num_heads=2, vocab_size=11),
                                   dict(d_model=24, d_ff=56, num_layers=3, num_heads=3, vocab_size=50),
                                   dict(d_model=64, d_ff=160, num_layers=2, num_heads=4, vocab_size=97)])
def test_parameter_count_matches_model(shape):
    cfg = ModelConfig(**shape, context_length=16)
    assert acc.parameter_count(cfg) == TransformerLM(cfg).num_parameters()


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_parameter_count_matches_every_named_size(size):
    cfg = config_for(size, context_length=128)
    with torch.device("meta"):  # no memory: only shapes are needed
        model = TransformerLM(cfg)
    assert acc.parameter_count(cfg) == model.num_parameters()


def test_parameter_count_by_hand():
    # small: V=10000, D=768, F=3072, L=12
    #   embedding + LM head 2*10000*768 = 15,360,000
    #   per block 4*768^2 = 2,359,296 + 3*768*3072 = 7,077,888 + 2*768 = 1,536 -> 9,438,720; x12 = 113,264,640
    #   final norm 768 -> 128,625,408
    assert acc.parameter_count(config_for("small")) == 128_625_408


def test_state_memory_by_hand():
    cfg = config_for("small", context_length=256)
    n = 128_625_408
    fp32 = acc.state_memory(cfg, "fp32")
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert fp32["weight_copies"] == 0
    # RoPE tables: 12 blocks x (cos + sin) x 256 positions x 32 (head_dim/2) x 4 bytes = 786,432
    assert fp32["buffers"] == 786_432
    assert fp32["total"] == 16 * n + 786_432
    mixed = acc.state_memory(cfg, "bf16_autocast")
    # bf16 copies of the matrices: 12*(4*768^2 + 3*768*3072) + 768*10000 = 113,246,208 + 7,680,000
    assert mixed["weight_copies"] == 2 * 120_926_208
    pure = acc.state_memory(cfg, "bf16")
    assert (pure["params"], pure["grads"], pure["optimizer"]) == (2 * n, 2 * n, 4 * n)
    with pytest.raises(ValueError, match="unknown precision policy"):
        acc.state_memory(cfg, "fp8")


# ---------------------------------------------------------------------------------------------- activations


def _measured_saved_bytes(cfg, batch, context, precision):
    """Bytes autograd saves in a forward + loss, each storage counted once, parameters and buffers excluded."""
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (batch, context))
    targets = torch.randint(0, cfg.vocab_size, (batch, context))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast"):
        lm_loss(model, tokens, targets)
    return sum(seen.values())


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast", "bf16"])
def test_saved_activations_match_autograd(attention, precision):
    cfg = ModelConfig(**TINY, attention=attention)
    batch, context = 5, 12
    measured = _measured_saved_bytes(cfg, batch, context, precision)
    predicted = acc.saved_activation_bytes(cfg, batch, context, precision, device_type="cpu")["total"]
    # autocast's bf16 weight copies are saved for backward too; accounting books them as state
    predicted += acc.state_memory(cfg, precision)["weight_copies"]
    assert measured == predicted


def test_saved_activations_by_hand():
    # fp32, SDPA, D=24, F=56, H=3, 2 blocks, batch 5 x context 12 = 60 tokens, V=50. Per token per block:
    #   norms 2 x (3*24 + 1) = 146, q,k,v,out 4*24 = 96, logsumexp 3, o_proj input 24, SwiGLU 4*56 = 224
    #   -> 493 elements x 4 B = 1,972 B; blocks: 2 x 60 x 1,972 = 236,640
    #   head per token: final norm 73*4 = 292, log-softmax 50*4 = 200, tokens + targets 16 -> 508; x60 + 4
    cfg = ModelConfig(**TINY)
    out = acc.saved_activation_bytes(cfg, 5, 12, "fp32")
    assert out["per_token_per_block"] == 1_972
    assert out["blocks"] == 236_640
    assert out["head"] == 60 * 508 + 4
    assert out["total"] == 236_640 + 30_484


def test_training_memory_is_the_sum_of_its_parts():
    cfg = config_for("small", context_length=128)
    state = acc.state_memory(cfg, "fp32")
    act = acc.saved_activation_bytes(cfg, 4, 128, "fp32")["total"]
    step = acc.training_memory(cfg, 4, 128, "fp32", "train_step")
    assert step["total"] == state["total"] + act
    fwd = acc.training_memory(cfg, 4, 128, "fp32", "forward")
    assert fwd["total"] == state["params"] + state["buffers"] + act
    with pytest.raises(ValueError, match="mode"):
        acc.training_memory(cfg, 4, 128, "fp32", "inference")


def test_step_peak_frees_activations_as_gradients_appear():
    """H100, 2.7B fp32, batch 4, context 512: forward+backward measured 29.5 GiB, train step 54.9 GiB; the
    sum of the parts said 42.4 and 67.8, the block-by-block peak says params + max(activations, grads)."""
    parts = dict(params=12.7, grads=12.7, optimizer=25.4, weight_copies=0.0, activations=17.0)
    assert acc.step_peak_bytes(parts, "forward") == pytest.approx(29.7)
    assert acc.step_peak_bytes(parts, "forward_backward") == pytest.approx(29.7)  # activations > gradients
    assert acc.step_peak_bytes(parts, "train_step") == pytest.approx(55.1)
    short = dict(parts, activations=2.69, weight_copies=6.3)  # bf16 autocast, context 128: gradients win
    assert acc.step_peak_bytes(short, "forward_backward") == pytest.approx(12.7 + 12.7)
    assert acc.step_peak_bytes(short, "forward") == pytest.approx(12.7 + 2.69 + 6.3)
    cfg = config_for("small", context_length=128)
    mem = acc.training_memory(cfg, 4, 128, "bf16_autocast", "forward_backward")
    assert mem["peak"] == mem["params"] + max(mem["activations"] + mem["weight_copies"], mem["grads"])
    assert mem["peak"] < mem["total"]


# ---------------------------------------------------------------------------------------------- FLOPs


def test_flops_match_torch_flop_counter():
    # naive attention: every matmul, the two score matmuls included, is visible to FlopCounterMode
    cfg = ModelConfig(**TINY, attention="naive")
    model = TransformerLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (5, 12))
    with FlopCounterMode(display=False) as forward:
        loss = lm_loss(model, tokens, tokens)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    assert forward.get_total_flops() == acc.forward_flops(cfg, 5, 12)
    assert backward.get_total_flops() == acc.backward_flops(cfg, 5, 12)


def test_flops_by_hand():
    # D=24, F=56, L=2, V=50, T=12, 60 tokens. Per token per block: 8*24^2 = 4,608 + 6*24*56 = 8,064
    #   + 4*12*24 = 1,152 -> 13,824; x2 blocks = 27,648 + LM head 2*24*50 = 2,400 -> 30,048; x60 = 1,802,880
    cfg = ModelConfig(**TINY)
    assert acc.forward_flops(cfg, 5, 12) == 1_802_880
    assert acc.training_flops(cfg, 5, 12) == 3 * 1_802_880


# ---------------------------------------------------------------------------------------------- collectives


def test_collective_closed_forms_by_hand():
    # S = 1 GB, N = 4, W = 100 GB/s: one shard is 0.25 GB, 3 steps of it take 7.5 ms
    s, n, w = 10**9, 4, 10**11
    assert float(acc.ring_all_gather_time(s, n, w)) == pytest.approx(7.5e-3)
    assert float(acc.ring_reduce_scatter_time(s, n, w)) == pytest.approx(7.5e-3)
    assert float(acc.ring_all_reduce_time(s, n, w)) == pytest.approx(15e-3)
    # alternate: 3 steps of the whole 1 GB -> 30 ms (N/2 = 2x the optimal one)
    assert float(acc.alternate_ring_all_reduce_time(s, n, w)) == pytest.approx(30e-3)
    assert float(acc.ring_all_reduce_bytes(s, n)) == 1.5e9
    # 1 us per step: all-reduce pays 6 of them
    assert float(acc.ring_all_reduce_time(s, n, w, 1e-6)) == pytest.approx(15e-3 + 6e-6)
    # symbolic: the optimal all-reduce tends to 2 S / W
    assert sp.limit(acc.ring_all_reduce_time(), acc.N, sp.oo) == 2 * acc.S / acc.W
    with pytest.raises(ValueError, match="unknown collective"):
        acc.collective_time("broadcast")


@pytest.mark.parametrize("name", list(acc.COLLECTIVES))
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("size_bytes", [8 * 48, 8 * 960, 8 * 9600])
def test_collective_closed_forms_match_simulator(name, n, size_bytes):
    w, latency = 2.5e9, 1e-6
    r = simulate(name, size_bytes, n, w, latency=latency)
    assert r.max_bytes_sent == acc.as_float(acc.collective_bytes(name), S=size_bytes, N=n)
    assert r.time_s == pytest.approx(acc.as_float(acc.collective_time(name, alpha=latency),
                                                  S=size_bytes, N=n, W=w), rel=1e-12)


# ---------------------------------------------------------------------------------------------- FFN parallelism

FFN = dict(B=96, D=8, F=24, C=1e12, W=1e9, p=8)  # p = 8: float64 elements, as the simulator sends


def test_ffn_costs_by_hand():
    # B=96 tokens, D=8, F=24, N=4, p=8 bytes: weights 3*8*24*8 = 4,608 B, activations B*D*p = 6,144 B
    v = dict(FFN, N=4)
    dp = acc.ffn_costs("dp", "train", matrices=3)
    assert acc.as_float(dp["flops"], **v) == 18 * 96 * 8 * 24 / 4  # 82,944
    assert acc.as_float(dp["comm_bytes"]["N"], **v) == 2 * 3 / 4 * 4608  # 6,912
    assert acc.as_float(acc.ffn_costs("dp", "forward", matrices=3)["comm_bytes"]["N"], **v) == 0
    fsdp_train = acc.ffn_costs("fsdp", "train", matrices=3)
    assert acc.as_float(fsdp_train["comm_bytes"]["N"], **v) == 3 * 3 / 4 * 4608  # 10,368
    assert acc.as_float(acc.ffn_costs("fsdp", "forward", matrices=3)["comm_bytes"]["N"], **v) == 3 / 4 * 4608  # 3,456
    tp = acc.ffn_costs("tp", "forward", matrices=3)
    assert acc.as_float(tp["comm_bytes"]["N"], **v) == 2 * 3 / 4 * 6144  # 9,216
    assert acc.as_float(tp["comm_time"]["N"], **v) == pytest.approx(9216 / 1e9)
    assert acc.as_float(tp["compute_time"], **v) == pytest.approx(6 * 96 * 8 * 24 / 4 / 1e12)
    # 2-D, X=2, Y=4: FSDP all-gathers 4,608/4 = 1,152 B per TP shard -> 1/2 of it sent, 3 times = 1,728 B;
    # TP moves (96/2)*8*8 = 3,072 B activations -> 3/4 of it, 4 times = 9,216 B
    two_d = acc.ffn_costs("fsdp_tp", "train", matrices=3)
    v2 = dict(FFN, X=2, Y=4, W_X=1e9, W_Y=1e9)
    assert acc.as_float(two_d["comm_bytes"]["X"], **v2) == 1728
    assert acc.as_float(two_d["comm_bytes"]["Y"], **v2) == 9216
    assert acc.as_float(two_d["flops"], **v2) == 18 * 96 * 8 * 24 / 8
    with pytest.raises(ValueError, match="unknown strategy"):
        acc.ffn_costs("pp", matrices=3)
    with pytest.raises(ValueError, match="matrices"):
        acc.ffn_costs("dp", matrices=4)


def _simulated_ffn_bytes(strategy, phase, n=None, x=None, y=None, matrices=3):
    """Bytes one device sends, by running each collective of the strategy through the ring simulator."""
    b, d, f, p = FFN["B"], FFN["D"], FFN["F"], FFN["p"]
    weights, train = matrices * d * f * p, phase == "train"

    def run(name, size, devices):
        return simulate(name, size, devices, FFN["W"]).max_bytes_sent

    if strategy == "dp":
        return run("all_reduce", weights, n) if train else 0
    if strategy == "fsdp":
        gathers = 2 if train else 1
        return gathers * run("all_gather", weights, n) + (run("reduce_scatter", weights, n) if train else 0)
    if strategy == "tp":
        pair = run("all_gather", b * d * p, n) + run("reduce_scatter", b * d * p, n)
        return 2 * pair if train else pair
    shard = weights // y
    gathers = 2 if train else 1
    on_x = gathers * run("all_gather", shard, x) + (run("reduce_scatter", shard, x) if train else 0)
    pair = run("all_gather", b // x * d * p, y) + run("reduce_scatter", b // x * d * p, y)
    return on_x, (2 * pair if train else pair)


@pytest.mark.parametrize("phase", ["forward", "train"])
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ffn_comm_bytes_match_simulator(strategy, phase, n):
    predicted = acc.as_float(acc.ffn_costs(strategy, phase, matrices=3)["comm_bytes"]["N"], **FFN, N=n)
    assert predicted == _simulated_ffn_bytes(strategy, phase, n=n)


@pytest.mark.parametrize("phase", ["forward", "train"])
@pytest.mark.parametrize("x,y", [(2, 2), (2, 4), (4, 2), (3, 8)])
def test_2d_comm_bytes_match_simulator(phase, x, y):
    costs = acc.ffn_costs("fsdp_tp", phase, matrices=3)
    on_x, on_y = _simulated_ffn_bytes("fsdp_tp", phase, x=x, y=y)
    assert acc.as_float(costs["comm_bytes"]["X"], **FFN, X=x, Y=y) == on_x
    assert acc.as_float(costs["comm_bytes"]["Y"], **FFN, X=x, Y=y) == on_y


def test_max_devices_by_hand():
    # DP training: 18 B D F / (N C) >= 2 (N-1)/N * 3 D F p / W  <=>  N <= 1 + 3 B W / (p C)
    # B = 1e6 tokens, W = 1e11 B/s, C = 1e15 FLOP/s, p = 2: N <= 1 + 3e17/2e15 = 151
    v = dict(B=10**6, W=10**11, C=10**15, p=2)
    assert acc.max_devices("dp", "train", **v, matrices=3) == 151
    # FSDP: N <= 1 + 2 B W / (p C) = 101; TP (F = 8192): N <= 1 + 9 F W / (2 p C) = 1 + 1.8432 = 2.8432
    assert acc.max_devices("fsdp", "train", **v, matrices=3) == 101
    assert float(acc.max_devices("tp", "train", F=8192, **v, matrices=3)) == pytest.approx(2.8432)
    assert acc.max_devices("dp", "forward", matrices=3) == sp.oo
    with pytest.raises(ValueError, match="unknown quantities"):
        acc.max_devices("dp", "train", N=4, matrices=3)
    with pytest.raises(ValueError, match="network"):
        acc.max_devices("dp", "train", "ethernet", matrices=3)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp"])
@pytest.mark.parametrize("phase", ["forward", "train"])
def test_max_devices_is_where_comm_equals_compute(strategy, phase):
    v = dict(B=4096, D=1024, F=4096, C=1e14, W=5e10, p=2)
    n_max = acc.max_devices(strategy, phase, **v, matrices=3)
    if n_max == sp.oo:
        return
    costs = acc.ffn_costs(strategy, phase, matrices=3)
    n_max = float(n_max)
    assert acc.as_float(costs["compute_time"], **v, N=n_max) == pytest.approx(
        acc.as_float(costs["comm_time"]["N"], **v, N=n_max), rel=1e-9)
    # a few more devices and communication dominates
    assert acc.as_float(costs["comm_time"]["N"], **v, N=n_max * 1.1) > acc.as_float(
        costs["compute_time"], **v, N=n_max * 1.1)


def test_max_devices_2d():
    v = dict(B=2**16, D=4096, F=16384, C=1e15, W=1e11, W_X=1e11, W_Y=1e11, p=2)
    over = acc.max_devices("fsdp_tp", "train", "overlapped", **v, matrices=3)
    # per-axis bounds: X <= 1 + 2 B W / (p C) = 1 + 6.5536, Y <= 1 + 9 F W / (2 p C) = 1 + 3.6864
    assert float(over["X"]) == pytest.approx(7.5536)
    assert float(over["Y"]) == pytest.approx(4.6864)
    assert float(over["N"]) == pytest.approx(7.5536 * 4.6864)
    shared = acc.max_devices("fsdp_tp", "train", "shared", **v, matrices=3)
    costs = acc.ffn_costs("fsdp_tp", "train", matrices=3)
    xs, ys = float(shared["X"]), float(shared["Y"])
    at = dict(v, X=xs, Y=ys)
    # on the boundary: the two axes' times add up to the compute time
    assert acc.as_float(costs["comm_time"]["X"] + costs["comm_time"]["Y"], **at) == pytest.approx(
        acc.as_float(costs["compute_time"], **at), rel=1e-9)
    # and no other point of that boundary has more devices
    for x in np.linspace(1.5, 8, 27):
        y_on_boundary = sp.solve(sp.Eq(costs["compute_time"], costs["comm_time"]["X"] + costs["comm_time"]["Y"])
                                 .subs({acc.W_X: acc.W, acc.W_Y: acc.W}).subs(
            {sym: v[sym.name] for sym in (acc.B, acc.D, acc.F, acc.C, acc.W, acc.p)}).subs(acc.X, x), acc.Y)
        assert x * float(y_on_boundary[0]) <= xs * ys * (1 + 1e-9)
    # sharing the link can only lower the device count
    assert xs * ys <= float(over["N"])


# ---------------------------------------------------------------------------------------------- XXL and TPU


def test_xxl_swiglu_variant_by_hand():
    # 126 blocks x 3 x 16384 x 53248 = 126 x 2,617,245,696 = 329,772,957,696 parameters
    params = acc.ffn_model_parameters(d_model=16384, d_ff=53248, blocks=126, matrices=3)
    assert params == 329_772_957_696
    # fp32 master weights + gradients + AdamW m and v: 16 B each -> 5,276,367,323,136 B = 5.28 TB
    state = 16 * params
    assert state == 5_276_367_323_136
    assert math.ceil(state / acc.H100_MEMORY_BYTES) == 66  # 65.95 H100s of 80 GB
    # bf16 saved activations: (16384 + 4 x 53248) = 229,376 elements x 2 B x 126 blocks = 57,802,752 B / token
    assert acc.ffn_saved_elements_per_token(16384, 53248, matrices=3) * 2 * 126 == 57_802_752
    # FSDP over 64 devices, no activations: 82.44 GB per device
    assert float(acc.fsdp_memory_per_device(state, 0, 64)) == pytest.approx(state / 64)
    # half of 100 GB of activations sharded over 4: 25/ + 50 -> 62.5 GB on top of the state shard
    assert float(acc.fsdp_memory_per_device(0, 100, 4)) == pytest.approx(62.5)


def test_tpu_compute_bound_batch_by_hand():
    # B / X >= C / (W_ici M_X) = 4.6e14 / (1.8e11 x 2) = 1277.78 tokens per FSDP shard; x16 -> 20,444
    tpu = dict(X=16, Y=4, C=acc.TPU_V5P["C"], W_ici=acc.TPU_V5P["W_ici"], M_X=2, M_Y=1, D=16384, F=53248)
    out = acc.fsdp_tp_compute_bound_batch("overlapped", matrices=3)
    assert acc.as_float(out["per_fsdp_shard"], **tpu) == pytest.approx(4.6e14 / 3.6e11)
    assert acc.as_float(out["B"], **tpu) == pytest.approx(16 * 4.6e14 / 3.6e11)
    assert acc.as_float(out["per_chip"], **tpu) == pytest.approx(4.6e14 / 3.6e11 / 4)
    # TP over Y = 4 is fine: 3 F M_Y W_ici / (2 C Y) = 3*53248*1.8e11/(2*4.6e14*4) = 7.81 >= 1
    assert bool(out["tp_ok"].subs({acc.F: 53248, acc.M_Y: 1, acc.W_ici: 1.8e11, acc.C: 4.6e14, acc.Y: 4}))
    # both axes' times added: B (6 F W_ici - 4 Y C / M_Y) >= 6 F X C / M_X -> B >= 23,445 tokens
    shared = acc.fsdp_tp_compute_bound_batch("shared", matrices=3)
    assert acc.as_float(shared["B"], **tpu) == pytest.approx(
        6 * 53248 * 16 * 4.6e14 / 2 / (6 * 53248 * 1.8e11 - 4 * 4 * 4.6e14), rel=1e-12)




def test_xxl_as_posed_two_matrices_by_hand():
    """The XXL question as posed: each block is two linear layers (up D x F, down F x D), no activation."""
    # 126 blocks x 2 x 16384 x 53248 = 219,848,638,464 parameters
    params = acc.ffn_model_parameters(d_model=16384, d_ff=53248, blocks=126)
    assert params == 219_848_638_464
    # fp32 weights + gradients + AdamW m and v: 16 B each -> 3,517,578,215,424 B = 3.52 TB = 43.97 H100s
    assert 16 * params == 3_517_578_215_424
    assert math.ceil(16 * params / acc.H100_MEMORY_BYTES) == 44
    # bf16 saved activations: the input of each matrix, (16384 + 53248) x 2 B x 126 = 17,547,264 B per token
    assert acc.ffn_saved_elements_per_token(16384, 53248) * 2 * 126 == 17_547_264
    m = acc.xxl_memory(2048)
    assert m["params"] == params and m["activation_bytes"] == 2048 * 17_547_264
    # forward FLOPs 4 B D F (two matrices), training 12 B D F
    v = dict(FFN, N=1)
    assert acc.as_float(acc.ffn_costs("dp", "forward")["flops"], **v) == 4 * 96 * 8 * 24
    assert acc.as_float(acc.ffn_costs("dp", "train")["flops"], **v) == 12 * 96 * 8 * 24
    # TP limit with two matrices: N <= 1 + 3 F W / (p C) = 1 + 3 x 8192 x 1e11 / 2e15 = 2.2288
    assert float(acc.max_devices("tp", "train", F=8192, B=10**6, W=10**11, C=10**15, p=2)) == pytest.approx(2.2288)
    # DP's bound does not depend on the number of matrices (FLOPs and gradient bytes both scale with it)
    assert acc.max_devices("dp", "train", B=10**6, W=10**11, C=10**15, p=2) == 151


def test_tpu_two_matrices_by_hand():
    tpu = dict(X=16, Y=4, C=acc.TPU_V5P["C"], W_ici=acc.TPU_V5P["W_ici"], M_X=2, M_Y=1, D=16384, F=53248)
    out = acc.fsdp_tp_compute_bound_batch("overlapped")
    # the FSDP condition B / X >= C / (W_ici M_X) is the same for any number of matrices
    assert acc.as_float(out["per_fsdp_shard"], **tpu) == pytest.approx(4.6e14 / 3.6e11)
    # TP stays compute bound while Y <= F M_Y W_ici / C = 53248 x 1.8e11 / 4.6e14 = 20.84 (the scaling book's
    # Y < M_Y F / 2550)
    assert bool(out["tp_ok"].subs({acc.F: 53248, acc.M_Y: 1, acc.W_ici: 1.8e11, acc.C: 4.6e14, acc.Y: 20}))
    assert not bool(out["tp_ok"].subs({acc.F: 53248, acc.M_Y: 1, acc.W_ici: 1.8e11, acc.C: 4.6e14, acc.Y: 21}))
    # shared link: B >= 2 F X C / M_X / (2 F W_ici - 2 Y C / M_Y)
    shared = acc.fsdp_tp_compute_bound_batch("shared")
    assert acc.as_float(shared["B"], **tpu) == pytest.approx(
        2 * 53248 * 16 * 4.6e14 / 2 / (2 * 53248 * 1.8e11 - 2 * 4 * 4.6e14), rel=1e-12)
# ---------------------------------------------------------------------------------------------- notebook tables


def test_devices_needed_by_hand():
    # 5,276.37 GB of state, no activations, 95 GB per device: 55.54 -> 56 devices
    assert acc.devices_needed(5_276_367_323_136, 0, 95 * 10**9) == 56
    # 100 GB state + 20 GB activations (half sharded), 30 GB devices: 100/N + 10/N + 10 <= 30 -> N >= 5.5 -> 6
    assert acc.devices_needed(100e9, 20e9, 30e9) == 6
    # the unsharded half of 80 GB activations (40 GB) never fits in 30 GB
    assert acc.devices_needed(100e9, 80e9, 30e9) is None


def test_xxl_memory_table():
    m = acc.xxl_memory(2048, matrices=3)
    assert m["activation_bytes"] == 2048 * 57_802_752
    # (5,276,367,323,136 + 118,380,036,096) / 80e9 = 67.43 -> 68 H100s
    assert m["devices_to_hold"] == 68
    table = acc.fsdp_table([0, 2048], devices=(64,), matrices=3)
    assert table.loc[0, "per_device_gb_N64"] == pytest.approx(5_276_367_323_136 / 64 / 1e9)
    # 2048 tokens: 118.38 GB activations -> 82.443 + 118.38 * (1/128 + 1/2) = 142.56 GB on 64 devices
    assert table.loc[1, "per_device_gb_N64"] == pytest.approx(82.4432394 + 118.380036096 * (1 / 128 + 0.5))


def test_tpu_tricks_lower_the_batch():
    tricks = acc.tpu_batch_tricks(matrices=3).set_index("trick").batch_tokens
    base = tricks.iloc[0]
    assert base == pytest.approx(16 * 4.6e14 / 3.6e11)
    # Y = 16 on 64 chips -> X = 4: B >= 4 x 1277.8 = 5111; M_X = 3: 16 x 4.6e14 / 5.4e11 = 13,630; fp8: base / 2
    assert tricks.iloc[1] == pytest.approx(4 * 4.6e14 / 3.6e11)
    assert tricks.iloc[2] == pytest.approx(16 * 4.6e14 / 5.4e11)
    assert tricks.iloc[3] == pytest.approx(base / 2)


def test_collective_table_matches_the_formulas():
    table = acc.collective_table(1e9, [2, 4], 1e11, latency=1e-6).set_index(["collective", "devices"])
    # all-reduce on 4 devices: 6 steps x (1 us + 0.25 GB / 100 GB/s) = 15.006 ms; 1.5 GB sent
    assert table.loc[("all_reduce", 4), "time_s"] == pytest.approx(15.006e-3)
    assert table.loc[("all_reduce", 4), "bytes_sent"] == 1.5e9
    # alternate on 2 devices: 1 step of the whole 1 GB = 10.001 ms
    assert table.loc[("alternate_all_reduce", 2), "time_s"] == pytest.approx(10.001e-3)


# ---------------------------------------------------------------------------------------------- the XXL tables


def test_xxl_table_by_hand():
    t = acc.xxl_table(2048).set_index("matrices")
    # two matrices: 2 x 16,384 x 53,248 x 126 = 219,848,638,464 parameters; 16 B each = 3,517.58 GB -> 44 H100s
    assert t.loc[2, "params"] == 219_848_638_464
    assert t.loc[2, "state_gb"] == pytest.approx(3517.578215424)
    parts = t.loc[2, "weights_gb"] + t.loc[2, "grads_gb"] + t.loc[2, "optimizer_gb"]
    assert parts == pytest.approx(t.loc[2, "state_gb"])
    assert t.loc[2, "devices_for_state"] == 44
    # saved per token: (16,384 + 53,248) x 2 B x 126 blocks = 17,547,264 B; x 2048 tokens = 35.94 GB -> 45 H100s
    assert t.loc[2, "activation_mb_per_token"] == pytest.approx(17.547264)
    assert t.loc[2, "activations_gb"] == pytest.approx(17_547_264 * 2048 / 1e9)
    assert t.loc[2, "devices_for_all"] == 45
    # SwiGLU: 3/2 of the parameters; (D + 4F) saved per token
    assert t.loc[3, "params"] == 3 * 219_848_638_464 // 2
    assert t.loc[3, "activation_mb_per_token"] == pytest.approx((16384 + 4 * 53248) * 2 * 126 / 1e6)


def test_xxl_fsdp_and_tpu_tables():
    fsdp = acc.xxl_fsdp_table([0, 2048]).set_index(["matrices", "tokens"])
    assert fsdp.loc[(2, 0), "devices_needed"] == 38  # 3,517.6 / 95 = 37.03
    # (3,517.58 + 35.94 / 2) / (95 - 35.94 / 2) = 45.9 -> 46
    assert fsdp.loc[(2, 2048), "devices_needed"] == 46
    tpu = acc.tpu_batch_table(**acc.TPU_MESH).set_index(["matrices", "case"])
    base = tpu.loc[(2, "large X: (X-1)/X = 1")]
    assert base["per_fsdp_shard"] == pytest.approx(4.6e14 / (1.8e11 * 2))
    assert base["total"] == pytest.approx(16 * 4.6e14 / 3.6e11)
    assert base["per_chip"] == pytest.approx(base["total"] / 64)
    # exact ring: T_math = T_FSDP (X-1)/X  ->  B/X = (15/16) C / (W M_X)
    assert tpu.loc[(2, "exact ring factor (X-1)/X"), "total"] == pytest.approx(15 / 16 * base["total"])
    # TP: 4 B D F / (X Y C) against 4 B D / (X W M_Y): ratio F W M_Y / (Y C); max Y = F W M_Y / C
    assert base["tp_math_over_comm"] == pytest.approx(53248 * 1.8e11 / (4 * 4.6e14))
    assert base["tp_max_y"] == pytest.approx(53248 * 1.8e11 / 4.6e14)
    assert tpu.loc[(3, "large X: (X-1)/X = 1"), "total"] == pytest.approx(base["total"])  # independent of the FFN
    tricks = acc.tpu_tricks_table().set_index("trick")["batch_tokens"]
    assert tricks.iloc[0] == pytest.approx(base["total"])
    assert tricks.iloc[1] == pytest.approx(4 * 4.6e14 / 3.6e11)  # Y = 16 (the largest power of 2 <= 20.8): X = 4


def test_ffn_limits_table():
    limits = acc.ffn_limits_table(10**6, 10**15, 10**11, matrices=3, d_model=8, d_ff=8192)
    lim = limits.set_index(["strategy", "phase", "network"])["max_devices"]
    # the hand-checked limits of test_max_devices_by_hand (B = 1e6, W = 1e11, C = 1e15, p = 2)
    assert lim["dp", "train", "either"] == 151 and lim["fsdp", "train", "either"] == 101
    assert lim["tp", "train", "either"] == pytest.approx(2.8432)
    assert math.isinf(lim["dp", "forward", "either"])
