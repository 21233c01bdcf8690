"""lab.kernels.flash_launch.launch: the direct relaunch of compiled kernels through Triton's internal launcher
only under the Triton release it was written for, the public ``kernel[grid](...)`` everywhere else.

On the CPU nothing compiles, so a stand-in kernel records how it was launched: ``kernel[grid](...)`` returns a
stand-in of the compiled kernel whose internal launcher records its calls, as Triton's does on a GPU.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
fl = pytest.importorskip("lab.kernels.flash_launch")


class CompiledStandIn:
    """What ``JITFunction.run`` returns on a GPU: the compiled kernel and its internal launcher."""

    packed_metadata = b"packed"
    function = 1234

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *params):
        return ("metadata", grid, stream)

    def run(self, *args):
        self.runs.append(args)


class KernelStandIn:
    """A ``@triton.jit`` function as :func:`launch` sees it: argument names, and ``kernel[grid](...)``."""

    arg_names = ["X", "n", "BLOCK"]

    def __init__(self):
        self.compiled = CompiledStandIn()
        self.public = []

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.public.append((grid, args, constexprs))
            return self.compiled
        return run


class DriverStandIn:
    class active:
        @staticmethod
        def get_current_stream(index):
            return 77


@pytest.fixture
def compiled_kernels(monkeypatch):
    """The launcher as it is with compiled kernels on a GPU (not the interpreter), Triton's driver stood in."""
    monkeypatch.setattr(fl, "INTERPRET", False)
    monkeypatch.setattr(fl, "driver", DriverStandIn)
    monkeypatch.setattr(fl, "_COMPILED", {})


def _launch_three_times(kernel, fast=True):
    x = torch.zeros(8)
    for _ in range(3):
        fl.launch(kernel, (2,), (x, 8), {"BLOCK": 16}, fast=fast)
    return x


def test_the_known_release_relaunches_through_the_compiled_kernel(monkeypatch, compiled_kernels):
    """Under the release it was written for, the first launch binds through ``kernel[grid]`` and the next ones
    call the compiled kernel's launcher with its grid (3-D), the stream, its handles and every argument."""
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kernel = KernelStandIn()
    x = _launch_three_times(kernel)
    assert len(kernel.public) == 1 and len(kernel.compiled.runs) == 2
    grid0, grid1, grid2, stream, function, packed, metadata, *hooks_and_params = kernel.compiled.runs[0]
    assert (grid0, grid1, grid2, stream, function, packed) == (2, 1, 1, 77, 1234, b"packed")
    assert metadata == ("metadata", (2, 1, 1), 77)
    assert hooks_and_params[2:] == [x, 8, 16]  # the arguments in the kernel's order, constexprs included


@pytest.mark.parametrize("version", ["3.7.0", "3.5.1", "4.0.0", "3", "nightly"])
def test_any_other_release_takes_the_public_launch(monkeypatch, compiled_kernels, version):
    """Triton's launcher internals are not public API: under another version every launch is
    ``kernel[grid](...)``, and the compiled kernel's launcher is never called."""
    monkeypatch.setattr(triton, "__version__", version)
    kernel = KernelStandIn()
    x = _launch_three_times(kernel)
    assert kernel.compiled.runs == []
    assert kernel.public == [((2,), (x, 8), {"BLOCK": 16})] * 3


def test_the_public_launch_when_asked_or_interpreted(monkeypatch, compiled_kernels):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kernel = KernelStandIn()
    _launch_three_times(kernel, fast=False)  # FlashConfig(fast_launch=False)
    assert len(kernel.public) == 3 and kernel.compiled.runs == []
    monkeypatch.setattr(fl, "INTERPRET", True)
    _launch_three_times(kernel)
    assert len(kernel.public) == 6 and kernel.compiled.runs == []


def test_relaunches_directly_reads_major_and_minor():
    assert fl.RELAUNCH_TRITON == (3, 6)
    assert fl.relaunches_directly("3.6.0") and fl.relaunches_directly("3.6.1+git8e4f2a1")
    for other in ("3.7.0", "3.5.1", "2.6.0", "3", "", "3.x"):
        assert not fl.relaunches_directly(other), other

