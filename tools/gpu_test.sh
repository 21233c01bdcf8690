#!/usr/bin/env bash
# Run the GPU tests (pytest -m gpu) on a lent GPU machine without network: pytest travels as wheels in .whl/
# (tools/render_wheels.sh; carry .whl). Usage: tools/gpu_test.sh [PYTEST ARGS ...]
#   tools/gpu_test.sh tests/kernels                     # the kernels' GPU tests
#   tools/gpu_test.sh tests/parallel -k two_gpus        # the data-parallel ones, on a machine of two GPUs
# The log comes back as $OUT/gpu_test.log.
set -uo pipefail
site=$(mktemp -d /tmp/site.XXXXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
# the lent machines' NVLink fabric has no SHARP multicast (see tools/gpu_render.sh); a value already set stands
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -m gpu -p no:cacheprovider -ra "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_test.log"
exit "${PIPESTATUS[0]}"
