"""Test-wide setup: Triton kernels run interpreted on a machine without a GPU (said in the report's header)."""

import torch

import lab

# Before any @triton.jit function is defined, i.e. before a test module imports lab's Triton modules; the
# processes the tests start (spawned ranks, command lines, notebook kernels) inherit it.
INTERPRETED = lab.use_triton_interpreter(announce=False)

import pytest  # noqa: E402


def pytest_report_header(config):
    return "triton: interpreted on the CPU (TRITON_INTERPRET=1)" if INTERPRETED else "triton: compiled"


#: The quick renders, longest first, each followed by a short one (their times alone on 2 cores: 03 104 s,
#: 05 82 s, 01 51 s, 10 69 s, 04 64 s; 06, 09, 07, 08, 02 17-31 s).
RENDER_ORDER = ("03_memory", "06_communication", "05_flash", "09_accounting", "10_fastest_step", "02_mixed_precision",
                "04_attention", "07_ddp", "01_profiling", "08_sharding")


def _render_rank(item) -> int:
    name = getattr(item, "callspec", None) and item.callspec.id
    return RENDER_ORDER.index(name) if name in RENDER_ORDER else len(RENDER_ORDER)


def pytest_collection_modifyitems(config, items):
    # The notebook renders (minutes each), then the other slow tests, first: pytest-xdist hands tests out in
    # this order, one or two at a time (`make test` passes --maxschedchunk 2; by default the first worker gets
    # a contiguous quarter of the suite, every render in it, and renders them one after another while the
    # other worker runs out of work), and a long test handed out last would run alone on one core at the end.
    # Among the renders, the longest go out each beside one of the shortest (RENDER_ORDER): a worker is handed
    # two at a time, and runs them one after the other.
    items.sort(key=lambda item: (item.originalname != "test_notebook_runs_quick", "slow" not in item.keywords,
                                 _render_rank(item)))
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
