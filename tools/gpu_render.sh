#!/usr/bin/env bash
# Render notebooks with the full profile on a lent GPU machine (no network there: papermill and its
# dependencies travel as wheels in .whl/, made by tools/render_wheels.sh and carried). Usage:
# tools/gpu_render.sh COMMIT TIMEOUT_S NN [NN ...]
# Everything produced (reports/, results/, the log) comes back as one tarball under $OUT.
# COMMIT is the clean commit of the tree being measured, read where the tree was committed (`git rev-parse
# HEAD` in your checkout): a device's copy of the working tree may carry an older .git.
set -uo pipefail
commit=$1; limit=$2; shift 2
[[ $commit =~ ^[0-9a-f]{40}$ ]] || { echo "COMMIT must be the full 40-digit hash (git rev-parse HEAD), got '$commit'"; exit 2; }
site=$(mktemp -d /tmp/site.XXXXXX)  # one per render: renders of separate GPUs may run side by side on one host
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$site:$PWD LAB_COMMIT=$commit PYTHONUNBUFFERED=1
# The lent machines' NVLink fabric has no SHARP multicast, and NCCL's init fails or hangs trying it: switched
# off here, for this script's renders (lab itself sets no NCCL variable); a value already set stands.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
# At the limit, kill every process this script started, the notebook kernel included: papermill starts it in
# a session of its own, so a plain `timeout` leaves it (and its worker processes) holding the pipe open and
# the render never ends; killed from the leaves up while it is still this tree's, the tarball below is made.
kill_tree() { local c; for c in $(pgrep -P "$1"); do [[ $c == "$BASHPID" ]] || { kill_tree "$c"; kill -9 "$c" 2>/dev/null; }; done; }
( sleep "$limit"; echo "render passed its ${limit} s limit: stopped" >&2; kill_tree $$ ) & watchdog=$!
# --resume: a report this commit already rendered is kept, and the tables it already measured on this kind of
# machine are read back, the rest measured: a report longer than one call is rendered in several. Between calls,
# unpack the returned bundle.tgz at the repository's root, so that the next call's copy of the tree has them
# (and carry results/partial, git-ignored: the rows a sweep logged before the limit stopped it).
timeout "$((limit + 15))" python3 -m lab.render --profile full --no-html --resume --only "$@" 2>&1 | tee "$OUT/render.log"
rc=${PIPESTATUS[0]}
# the watchdog, then its sleep (which holds the output open: the call would otherwise last the whole limit)
sleeper=$(pgrep -P "$watchdog"); kill -9 "$watchdog" 2>/dev/null; [[ -n $sleeper ]] && kill $sleeper 2>/dev/null
tar czf "$OUT/bundle.tgz" reports results 2>/dev/null
ls -la reports results | head -50
exit "$rc"
