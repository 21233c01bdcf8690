"""Test-wide setup: Triton kernels run interpreted on a machine without a GPU."""

import os

import torch

# Must be set before any @triton.jit function is defined, i.e. before lab's Triton modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
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
