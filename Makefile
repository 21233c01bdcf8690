# The lab book's entry points. `make book` and `make test` work on a fresh machine: they create .venv first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# CPU build by default; on a GPU machine: make book-full TORCH=torch (or your pinned CUDA build)
TORCH ?= torch==2.13.0

# test processes (pytest-xdist): two more than the cores (at most 8), each with one intra-op thread. Part of the
# suite waits rather than computes (ranks starting, deadlines running out, subprocesses), which the extra
# processes fill; and with torch's default of a thread per core, the processes' threads (the notebook kernels'
# and the ranks' too) spin against each other. On 2 cores, one run each: 767 s of tests with 3 processes and
# default threads, 685 s with one thread, 617 s with 4 processes and one thread (CPU time 20 -> 14 minutes).
# An OMP_NUM_THREADS you set stands.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 6 ? n + 2 : 8 )))
TEST_THREADS = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

.PHONY: setup book book-full html site test test-fast lint sync clean

# Made again when pyproject.toml changes (new dependencies reach an existing .venv; torch is kept).
READY := $(VENV)/.installed

$(READY): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# CPU build of torch from the local wheel cache; a GPU user installs their own CUDA torch first.
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)"
	# triton 3.6 + numpy<2.3: the Triton interpreter runs the kernels on the CPU
	$(VPY) -m pip install -q -e ".[dev]" "triton==3.6.0; platform_system == 'Linux'" "numpy<2.3"
	$(VPY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(READY)

book: $(READY)          ## render the quick lab book on the CPU into reports/quick/
	$(VPY) -m lab.render --profile quick

book-full: $(READY)     ## render the full lab book on a GPU machine into reports/
	$(VPY) -m lab.render --profile full

html: $(READY)          ## HTML export of the executed full reports
	$(VPY) -m lab.render --profile full --html-only

site: $(READY)          ## the rendered reports as one offline website: build/site/index.html
	$(VPY) -m lab.book.site

test: $(READY)          ## the whole test suite, JOBS processes (CI runs this and `make lint`)
	$(TEST_THREADS) $(VPY) -m pytest -q -ra -n $(JOBS) --maxschedchunk 2 --durations=25

test-fast: $(READY)     ## everything except the notebook renders and other slow tests
	$(TEST_THREADS) $(VPY) -m pytest -q -n $(JOBS) --maxschedchunk 2 -m "not slow"

lint: $(READY)
	$(VPY) -m ruff check lab tests examples tools

sync: $(READY)          ## update each notebook pair (notebooks/NN.py <-> NN.ipynb) from whichever was edited last
	$(VPY) -m jupytext --quiet --sync notebooks/[0-9][0-9]_*.py

clean:
	rm -rf reports/quick results/quick artifacts build
