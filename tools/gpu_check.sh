#!/usr/bin/env bash
# Device call: the kernels' GPU checks, tuning sweeps and benchmarks, the GPU tests, and a smoke of the fastest step.
# On two GPUs: the FlashAttention check on GPU 0; the fused-loss check, the GPU tests and the 2.7B step on
# GPU 1 at the same time; then the leaderboard step's shape with 4 layers on both.
# Usage: tools/gpu_check.sh COMMIT   (everything comes back as $OUT/bundle.tgz plus $OUT/summary.txt)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LAB_COMMIT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$OUT/work; mkdir -p "$W/flash" "$W/loss"
S=$OUT/summary.txt
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"; } | tee "$S"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
SECOND=$([ "$GPUS" -ge 2 ] && echo 1 || echo 0)
(CUDA_VISIBLE_DEVICES=0 timeout 400 python3 tools/flash_gpu_check.py --budget-s 270 --workers 12 --out "$W/flash" \
   > "$W/flash.log" 2>&1; echo "flash check exit $?" >> "$S") &
(export CUDA_VISIBLE_DEVICES=$SECOND
 timeout 250 python3 -m lab.bench.fused_loss --check --results-dir "$W/loss" > "$W/loss.log" 2>&1
 echo "loss check exit $?" >> "$S"
 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/recipes > "$W/pytest_gpu.log" 2>&1
 echo "gpu tests exit $?" >> "$S"
 timeout 150 python3 -m lab.fastest --config 2.7B --rep-ms 1500 --recipes project stock_compiled \
   > "$W/fastest_27B.log" 2>&1; echo "fastest 2.7B exit $?" >> "$S") &
wait
timeout 150 python3 -m lab.fastest --config leaderboard --world-size "$GPUS" --num-layers 4 --rep-ms 1 \
  --recipes project stock_compiled > "$W/fastest_leaderboard_4layers.log" 2>&1; echo "fastest 4 layers exit $?" >> "$S"
for f in "$W"/*.log "$W"/flash/summary.md; do echo "=== $f"; tail -n 40 "$f"; done >> "$S" 2>/dev/null
tar czf "$OUT/bundle.tgz" -C "$OUT" work
rm -rf "$W"
tail -n 60 "$S"
