#!/usr/bin/env bash
# GPU calls for session 28 (issue 68), nvidia-h200 (one GPU): the compiled losses (working tree) against HEAD 1724217
# (before.tgz: `git archive HEAD`), one benchmark at a time on one host.
# 1 carry [".gpu/stage", ".gpu/f5", ".gpu/run"]: bash .gpu/run/s28.sh stage && bash /tmp/gpuS/s28.sh go
# 2.. bash /tmp/gpuS/s28.sh wait 550 N   (N: how many runs must have finished)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/ipython-shim Y9=/tmp/yolov9 PYTHONPYCACHEPREFIX=/tmp/pyc
RUNS="cudagraphs:16:after cudagraphs:16:before inductor:16:after inductor:16:before cudagraphs:32:after cudagraphs:32:before inductor:32:after inductor:32:before"
cmd=$1; shift
case $cmd in
stage)
  . .gpu/stage/stage.sh .gpu/f5
  mkdir -p /tmp/gpuS /tmp/tp /tmp/before && cp -r .gpu/run/* /tmp/gpuS/
  git log --oneline -1; git status --short | head -8
  bash patch_yolov9.sh /tmp/yolov9 > /dev/null && cat /tmp/yolov9/.yolov9_qat_commit
  tar -xzf .gpu/run/before.tgz -C /tmp/before && cp -r /tmp/yolov9 /tmp/yolov9b && bash /tmp/before/patch_yolov9.sh /tmp/yolov9b > /dev/null
  diff -q /tmp/yolov9/models/core/sync_free_loss.py /tmp/yolov9b/models/core/sync_free_loss.py
  nproc; lscpu | grep "Model name"; nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
go)
  setsid nohup bash /tmp/gpuS/s28.sh chain > /tmp/tp/bg-chain.out 2>&1 < /dev/null &
  ;;
chain)  # one run at a time
  for r in $RUNS; do
    IFS=: read step batch code <<< "$r"; tag=$step-b$batch-$code; dir=/tmp/yolov9; [ $code = before ] && dir=/tmp/yolov9b
    mkdir -p /tmp/tp/$tag; cd $dir
    TORCH_LOGS=recompiles CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark_throughput.py --cfg models/detect/gelan-c.yaml \
      --data /tmp/helmet-416/data.yaml --imgsz 640 --cache ram --step $step --batch-size $batch --workers 15 \
      --loader-batches 0 --warmup 15 --steps 60 --breakdown-steps 5 --out /tmp/tp/$tag --device 0 \
      > /tmp/tp/$tag.log 2>&1; echo "rc $? $tag" >> /tmp/tp/$tag.log
  done
  ;;
wait)  # wait SECONDS N: until N runs have an rc line, or SECONDS; then the results so far
  end=$(( $(date +%s) + $1 )); want=$2
  while [ $(date +%s) -lt $end ]; do
    n=$(grep -l '^rc ' /tmp/tp/*.log 2>/dev/null | wc -l); [ $n -ge $want ] && break; sleep 5
  done
  for f in /tmp/tp/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "img/s|rc |Error|error|graphs|QAT step" "$f" | cut -c1-400 | tail -6; }; done
  tar -czf $OUT/tp.tgz -C /tmp tp
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  ;;
esac
