"""Test-wide setup: Triton kernels run interpreted on a machine without a GPU (said in the report's header)."""

import torch

import lab

# Before any @triton.jit function is defined, i.e. before a test module imports lab's Triton modules; the
# processes the tests start (spawned ranks, command lines, notebook kernels) inherit it.
INTERPRETED = lab.use_triton_interpreter(announce=False)

import pytest  # noqa: E402


def pytest_report_header(config):
    return "triton: interpreted on the CPU (TRITON_INTERPRET=1)" if INTERPRETED else "triton: compiled"


def pytest_collection_modifyitems(config, items):
    # The notebook renders (minutes each), then the other slow tests, first: pytest-xdist hands tests out in
    # this order, one or two at a time (`make test` passes --maxschedchunk 2; by default the first worker gets
    # a contiguous quarter of the suite, every render in it, and renders them one after another while the
    # other worker runs out of work), and a long test handed out last would run alone on one core at the end.
    items.sort(key=lambda item: (item.originalname != "test_notebook_runs_quick", "slow" not in item.keywords))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _close_figures():
    """Figures the tests draw are closed after each test (pyplot keeps them all alive otherwise)."""
    yield
    import sys

    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
