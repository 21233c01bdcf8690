#!/usr/bin/env bash
# Device call: the kernels' GPU checks and tuning sweeps, the GPU tests, and a smoke of the fastest step.
# On two GPUs the FlashAttention check (GPU 0) and the fused-loss check (GPU 1) run at the same time.
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
(CUDA_VISIBLE_DEVICES=0 timeout 340 python3 tools/flash_gpu_check.py --budget-s 300 --out "$W/flash" > "$W/flash.log" 2>&1; echo "flash check exit $?" >> "$S") &
(CUDA_VISIBLE_DEVICES=$SECOND timeout 260 python3 tools/fused_loss_gpu_check.py --budget-s 210 --out "$W/loss" > "$W/loss.log" 2>&1; echo "loss check exit $?" >> "$S"
 CUDA_VISIBLE_DEVICES=$SECOND timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/recipes > "$W/pytest_gpu.log" 2>&1; echo "gpu tests exit $?" >> "$S") &
wait
timeout 200 python3 -m lab.fastest --config leaderboard --world-size "$GPUS" --num-layers 4 --rep-ms 1 \
  --recipes project stock_compiled stock_eager > "$W/fastest_leaderboard_4layers.log" 2>&1; echo "fastest 4 layers exit $?" >> "$S"
timeout 120 python3 -m lab.fastest --config 2.7B --rep-ms 1500 --recipes project stock_compiled > "$W/fastest_27B.log" 2>&1
echo "fastest 2.7B exit $?" >> "$S"
for f in "$W"/*.log; do echo "=== $(basename "$f")"; tail -n 25 "$f"; done >> "$S"
tar czf "$OUT/bundle.tgz" -C "$OUT" work
rm -rf "$W"
tail -n 120 "$S"
