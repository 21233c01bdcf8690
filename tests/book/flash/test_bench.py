"""lab.book.flash.bench: the grid's sweeps and skip rule."""

from lab.bench.attention import attention_impl
from lab.bench.attention_grid import Shape
from lab.book.flash import bench as fl


def test_skip_pytorch_flash_rule():
    skip = fl.skip_pytorch_flash(max_seq=2048, dtypes=("bf16",))
    assert skip("pytorch_flash", Shape(1, 16, 2048, 64), "bf16") is None
    assert skip("pytorch_flash", Shape(1, 16, 4096, 64), "bf16")  # too long for its Python tile loop
    assert skip("pytorch_flash", Shape(1, 16, 1024, 64), "fp16")  # one dtype is enough
    assert skip("triton", Shape(1, 16, 65536, 64), "fp16") is None


def test_flash_benchmark_labels_its_sweeps():
    df = fl.run_flash_benchmark({"lm": dict(shapes=[Shape(1, 2, 16, 8)], dtypes=("bf16",)),
                                 "fp32": dict(shapes=[Shape(1, 1, s, 8) for s in (16, 32)], dtypes=("fp32",))},
                                impls={"sdpa": attention_impl("sdpa", "cpu")}, cpu_steps=1, device="cpu",
                                progress=False)
    assert df["sweep"].tolist() == ["lm", "fp32", "fp32"] and df["dtype"].tolist() == ["bf16", "fp32", "fp32"]
