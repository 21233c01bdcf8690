"""Fixtures of the kernels' tests."""

import pytest
import torch


@pytest.fixture
def compiled_triton(monkeypatch):
    """This process as one whose Triton compiles kernels (not the interpreter), on a GPU of the capability the
    test sets (``set(capability)``): the dispatch tests of the forward and the backward."""
    fd = pytest.importorskip("lab.kernels.flash_dispatch")
    monkeypatch.setattr(fd, "INTERPRET", False)
    return lambda capability: monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
