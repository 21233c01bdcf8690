#!/usr/bin/env bash
# The wheels tools/gpu_render.sh and tools/gpu_test.sh install on a GPU machine without network: papermill and
# a Jupyter kernel, and pytest, with their dependencies, built for that machine's Python (3.12 unless given),
# downloaded into .whl/ here.
# git ignores .whl/: name it in the device tool's `carry` (about 20 MB).
# Usage: tools/render_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
[[ $py =~ ^3\.[0-9]+$ ]] || { echo "PYTHON_VERSION must look like 3.12, got '$py'"; exit 2; }
python3 -m pip download -q --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d .whl papermill ipykernel pytest
echo "$(ls .whl/*.whl | wc -l) wheels in .whl/ for Python $py"
