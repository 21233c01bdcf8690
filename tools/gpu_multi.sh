#!/usr/bin/env bash
# Several full-profile renders side by side on one multi-GPU host, each on its own GPUs and in its own copy of
# the tree; a spec's renders separated by ';' run one after the other on its GPUs. Everything comes back as ONE
# tarball, $OUT/all.tgz: the device tool returns only a few files per call and drops the rest without an error.
# Usage: tools/gpu_multi.sh COMMIT TIMEOUT_S "GPUS|NAME|NN [-p NAME VALUE ...][; NN ...]" ...
#   e.g. tools/gpu_multi.sh $(git rev-parse HEAD) 540 "0,1,2|r10|10" "3|r05|05 -p dtypes \"['bf16']\""
# TIMEOUT_S bounds each render (tools/gpu_render.sh); the host's CPUs are shared, which slows host-bound steps.
set -u
commit=$1; limit=$2; shift 2
out=$OUT
for spec in "$@"; do
  IFS='|' read -r gpus name renders <<<"$spec"
  mkdir -p "/tmp/r$name" "$out/$name"
  tar cf - --exclude=./.git . | tar xf - -C "/tmp/r$name"
  (
    cd "/tmp/r$name" || exit 1
    IFS=';' read -ra each <<<"$renders"
    for i in "${!each[@]}"; do
      mkdir -p "$out/$name/$i"
      eval "CUDA_VISIBLE_DEVICES=$gpus OUT=$out/$name/$i bash tools/gpu_render.sh $commit $limit ${each[$i]}" \
        > "$out/$name/$i.log" 2>&1 < /dev/null
      echo "rc=$?" >> "$out/$name/$i.log"
    done
  ) &
done
wait
for spec in "$@"; do
  IFS='|' read -r gpus name renders <<<"$spec"
  for log in "$out/$name"/*.log; do echo "== $name ${log##*/}"; grep -v "^-rw\|^total\|^d\|^\[progress\]" "$log" | tail -4; done
done
cd "$out" && tar czf all.tgz --exclude=all.tgz . && find . -mindepth 1 -maxdepth 1 ! -name all.tgz -exec rm -rf {} +
ls -la "$out"
