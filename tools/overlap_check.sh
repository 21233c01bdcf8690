#!/usr/bin/env bash
# Time the optimizer inside the backward and DDP's hidden communication on a GPU machine of two GPUs
# (python -m lab.bench.overlap): one part per call, each within the device tool's 10 minutes.
# Usage: tools/overlap_check.sh COMMIT PART [SIZE] [TIMEOUT_S]
#   tools/overlap_check.sh $(git rev-parse HEAD) one_gpu        # 2.7B on GPU 0: plain, block-compiled, optimizer
#                                                               # inside the backward, clipped, stock compiled bf16
#   tools/overlap_check.sh $(git rev-parse HEAD) ddp 2.7B      # two ranks, batch 2 each: one GPU, torch DDP (+bf16),
#   tools/overlap_check.sh $(git rev-parse HEAD) ddp xl        # ours in reverse and backward order, bf16, in-backward
# The tables, their provenance and the log come back as one tarball, $OUT/overlap_<part>_<size>.tgz, and beside
# it (as ..._traces.tgz) the profiled steps' traces when they fit in 16 MB compressed.
# COMMIT is the clean commit of the tree being measured (`git rev-parse HEAD` in your checkout): a device's
# copy of the working tree may carry an older .git. Extra arguments for lab.bench.overlap go in $OVERLAP_ARGS
# (e.g. OVERLAP_ARGS="--rounds 8 --bucket-mb 50").
set -uo pipefail
commit=$1; part=$2; size=${3:-2.7B}; limit=${4:-560}
[[ $commit =~ ^[0-9a-f]{40}$ ]] || { echo "COMMIT must be the full 40-digit hash (git rev-parse HEAD), got '$commit'"; exit 2; }
[[ $part == one_gpu || $part == ddp ]] || { echo "PART must be one_gpu or ddp, got '$part'"; exit 2; }
export PYTHONPATH=$PWD LAB_COMMIT=$commit PYTHONUNBUFFERED=1
# the lent machines have no NVLink multicast: NCCL and symmetric memory must not try it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=$(mktemp -d /tmp/overlap.XXXXXX)
name=overlap_${part}_${size}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
  ranks=(); [[ $part == ddp ]] && ranks=(--world-size 2)
  # shellcheck disable=SC2086
  timeout "$limit" python3 -m lab.bench.overlap --part "$part" --size "$size" "${ranks[@]}" \
    --results-dir "$work/results" --artifacts-dir "$work/artifacts" ${OVERLAP_ARGS:-}
  echo "rc=$?"
} 2>&1 | tee "$work/$name.log"
tar czf "$OUT/$name.tgz" -C "$work" results "$name.log" 2>/dev/null
# the profiled steps' traces, one compressed tarball if it fits what the device tool returns (16 MiB a file)
tar czf "$work/traces.tgz" -C "$work/artifacts" overlap_traces 2>/dev/null \
  && [ "$(stat -c %s "$work/traces.tgz")" -lt 16000000 ] && cp "$work/traces.tgz" "$OUT/${name}_traces.tgz"
ls -la "$OUT"
grep -q "^rc=0$" "$work/$name.log"
