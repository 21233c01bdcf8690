"""The Triton FlashAttention kernels compiled for Hopper (sm_90a) on a machine without a GPU.

The interpreter checks what the kernels compute but not whether Triton's GPU compiler accepts them: a
kernel can be right under TRITON_INTERPRET=1 and still fail to compile, or need more shared memory than
an SM has, or spill registers. Triton compiles for any target without a device (``triton.compile`` with
a ``GPUTarget``), and its wheel ships ``ptxas``, whose ``-v`` report gives registers and spills. The
compiles run in a subprocess without TRITON_INTERPRET (under it, ``@triton.jit`` makes interpreted
functions, which do not compile); shapes stay few, each compile takes a few seconds.
"""


import pytest
import torch

triton = pytest.importorskip("triton")
fc = pytest.importorskip("lab.kernels.flash_config")
flash_sm90 = pytest.importorskip("lab.kernels.flash_sm90")
from lab.kernels.sm90_compile import product_waits  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    CUDABackend(GPUTarget("cuda", 90, 32))
except Exception as exc:  # a Triton without the NVIDIA backend
    pytest.skip(f"no Triton CUDA backend here ({exc})", allow_module_level=True)

MAX_SHARED = 232448  # bytes of shared memory a block may use on an H100/H200 (227 KB)


def table(monkeypatch, d, dtype, batch_heads=64, n=4096):
    """The tile tables as they are on an H100 (132 SMs), for a long sequence whose heads fill the GPU
    (:func:`lab.kernels.flash_sm90.default_plan`, as the compiled kernels see them)."""
    monkeypatch.setattr(fc, "INTERPRET", False)
    return flash_sm90.default_plan(d, dtype, batch_heads, n)


def compile_in_subprocess(jobs: list) -> list:
    """:func:`lab.kernels.flash_sm90.compile_in_subprocess`, skipped where Triton ships no ptxas."""
    try:
        return flash_sm90.compile_in_subprocess(jobs)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 80])
def test_default_bf16_kernels_compile_for_hopper(monkeypatch, d):
    """The defaults for long bf16 sequences (at d = 80 the split head dimension, 64 + 16 columns) fit in
    shared memory and spill nothing. (At d = 128 the dK/dV kernel on 64 x 128 tiles, 8 warps, spills a few
    bytes a thread, as the padded d = 80 kernel did; the sweep measured it fastest anyway.)"""
    fwd_tiles, mode, bwd_tiles = table(monkeypatch, d, torch.bfloat16)
    split = fc.head_chunks(d, torch.bfloat16, "bwd", 4096, 4096)[1] > 0
    assert mode == "two_pass" and split == (d == 80)
    reports = compile_in_subprocess([["fwd", dict(d=d, causal=True, tiles=fwd_tiles, split=split)]] +
                                    [["bwd", dict(d=d, causal=True, tiles=bwd_tiles[p], pass_=p, split=split)]
                                     for p in (1, 2)])
    assert all(r["shared"] <= MAX_SHARED and r["spill"] == 0 for r in reports), reports


@pytest.mark.slow
def test_variants_and_fp32_compile_for_hopper(monkeypatch):
    """Atomic dQ with D computed in the kernel, atomic dQ as TMA bulk reductions, and TMA descriptors in both
    directions compile for sm_90a without spills at d = 64 (the interpreter cannot tell: it emulates
    descriptors and atomics, and has no bulk reduction at all); the fp32
    forward table at d = 128, sized for 3xTF32 (each operand split in two TF32 halves), does not spill
    either (larger tiles spill hundreds of bytes)."""
    fp32_tiles, _, _ = table(monkeypatch, 128, torch.float32)
    reports = compile_in_subprocess([
        ["fwd", dict(d=64, causal=True, tiles=(128, 64, 8, 3), tma=True)],
        ["bwd", dict(d=64, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=1, atomic=True, delta_from_o=True)],
        ["bwd", dict(d=64, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=1, atomic=True, atomic_tma=True)],
        ["bwd", dict(d=64, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=2, delta_from_o=True, store_delta=True,
                     tma=True)],
        ["fwd", dict(d=128, causal=True, tiles=fp32_tiles, dtype="fp32")],
        ["bwd", dict(d=64, causal=False, tiles=(64, 64, 64, 64, 4, 3), pass_=1, ordered=True)]])
    assert all(r["shared"] <= MAX_SHARED and r["spill"] == 0 for r in reports), reports
    assert reports[-1]["products"] == 5  # the ordered launch: 5 products, dQ's among them


@pytest.mark.slow
def test_kernels_compile_with_fp64_scales_as_inductor_passes_them():
    """Inductor types a Python float argument of a kernel it launches as fp64 (``FlashConfig.compile_inline``
    hands it these kernels); the kernels turn their scales into fp32 first, so an fp64 scale neither turns
    the softmax into fp64 (which ``tl.dot``'s fp32 accumulator refuses) nor costs fp64 arithmetic: the
    forward and every backward pass compile for sm_90a with the same shared memory as with fp32 scales."""
    jobs = [["fwd", dict(d=80, causal=True, tiles=(64, 64, 4, 3))],
            ["bwd", dict(d=80, causal=True, tiles=(32, 64, 64, 32, 4, 2), pass_=0)],
            ["bwd", dict(d=80, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=1)],
            ["bwd", dict(d=80, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=2)]]
    fp32 = compile_in_subprocess(jobs)
    fp64 = compile_in_subprocess([[kind, {**kwargs, "scale": "fp64"}] for kind, kwargs in jobs])
    assert [r["shared"] for r in fp64] == [r["shared"] for r in fp32], (fp64, fp32)


PTX = """
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd3, %rd4, 1, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    wgmma.wait_group.sync.aligned 0;
    ex2.approx.ftz.f32 %f9, %f8;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f2}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    ex2.approx.ftz.f32 %f10, %f8;
    wgmma.wait_group.sync.aligned 0;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f3}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f4}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    wgmma.wait_group.sync.aligned 1;
    wgmma.wait_group.sync.aligned 0;
"""


def test_product_waits_follows_commit_groups_and_pending_counts():
    """Four products: the first waited for at once, the second under an exponential, the third under the
    fourth (retired by ``wait_group 1``, which leaves the newest group running), the fourth at once."""
    assert product_waits(PTX) == {"products": 4, "waited_at_once": 2}
    assert product_waits("") == {"products": 0, "waited_at_once": 0}


@pytest.mark.slow
def test_forward_waits_for_every_product_and_dkdv_keeps_its_accumulations_in_flight():
    """What Triton makes of the kernels, read from the PTX: the default forward waits for each of its products (2
    per key loop, two loops) before anything else is issued; the dK/dV kernel keeps some in flight (its dK and dV
    accumulations). A Triton that overlaps the forward's products fails this test: then a forward that issues the
    next tile's scores first is worth a sweep again."""
    from lab.bench.flash_variants import product_wait_table

    table = product_wait_table(head_dims=(64,))
    if "note" in table:
        pytest.skip(table["note"].iloc[0])
    by = table.set_index("kernel")
    assert by.loc["forward", "products"] == 4 and by.loc["forward", "in_flight"] == 0
    assert 0 < by.loc["backward dK/dV", "in_flight"] < by.loc["backward dK/dV", "products"]
    assert set(by.index) == {"forward", "backward dK/dV", "backward dQ"}


def _ptxas_wrapper(tmp_path, body: str):
    """A ptxas at ``tmp_path/ptxas`` that logs its arguments, runs ``body`` (shell) and then the real one."""
    from lab.kernels.sm90_compile import ptxas_path

    real = ptxas_path()
    if not real.exists():
        pytest.skip(f"no ptxas here ({real})")
    log, wrapper = tmp_path / "calls", tmp_path / "ptxas"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{body}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


FORWARD_JOB = [["fwd", dict(d=64, causal=True, tiles=[64, 64, 4, 2])]]


@pytest.mark.slow
def test_the_report_reads_ptx_with_the_ptxas_triton_compiled_with(tmp_path, monkeypatch):
    """Inductor points ``TRITON_PTXAS_PATH`` at torch's own ptxas once it compiles anything, and Triton then
    writes PTX of that ptxas's version; the ``-v`` report must run the same ptxas, not the wheel's (which may
    be older and reject the PTX: the product-wait table failed so on a GPU machine, after Inductor had run)."""
    wrapper, log = _ptxas_wrapper(tmp_path, "")
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(wrapper))
    (report,) = compile_in_subprocess(FORWARD_JOB)
    assert report["products"] == 4 and report["registers"] > 0
    ours = [line for line in log.read_text().splitlines() if "-arch=sm_90a" in line and "kernel.ptx" in line]
    assert len(ours) == 1 and ours[0].startswith("-v ")


@pytest.mark.slow
def test_a_ptxas_failure_says_what_ptxas_said(tmp_path, monkeypatch):
    """Triton's own compile passes; the report's run fails, and the error carries ptxas's last line."""
    fail = 'case "$*" in *kernel.ptx*) echo "ptxas fatal : Unsupported .version 9.0" >&2; exit 255;; esac'
    wrapper, _ = _ptxas_wrapper(tmp_path, fail)
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(wrapper))
    with pytest.raises(RuntimeError) as err:
        compile_in_subprocess(FORWARD_JOB)
    last = str(err.value).strip().splitlines()[-1]
    assert "exited 255: ptxas fatal : Unsupported .version 9.0" in last
