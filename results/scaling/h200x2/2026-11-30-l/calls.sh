#!/usr/bin/env bash
# GPU calls for session 28, nvidia-h200-x2: DistributedDataParallel's options at global batch 64 (32 a GPU), gelan-c 640
# 1 carry [".gpu/stage", ".gpu/f5", ".gpu/run"]: bash .gpu/run/s28b.sh stage && bash /tmp/gpuS/s28b.sh go
# 2.. bash /tmp/gpuS/s28b.sh wait 550 N
# The device copy only (not committed): the benchmark runs the QAT arm alone (its control entry a copy of it), and
# data_parallel passes DDP_EXTRA (JSON) to DistributedDataParallel.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/ipython-shim Y9=/tmp/yolov9 PYTHONPYCACHEPREFIX=/tmp/pyc
A="--cfg models/detect/gelan-c.yaml --data /tmp/helmet-416/data.yaml --imgsz 640 --cache ram --step inductor --loader-batches 0 --warmup 15 --steps 60 --breakdown-steps 5 --batch-size 64"
RUNS='default:{} view-cap100:{"gradient_as_bucket_view":true,"bucket_cap_mb":100} default2:{} view:{"gradient_as_bucket_view":true}'
cmd=$1; shift
case $cmd in
stage)
  . .gpu/stage/stage.sh .gpu/f5
  mkdir -p /tmp/gpuS /tmp/tp && cp -r .gpu/run/* /tmp/gpuS/
  git log --oneline -1; git status --short | head -5
  bash patch_yolov9.sh /tmp/yolov9 > /dev/null && cat /tmp/yolov9/.yolov9_qat_commit
  cd /tmp/yolov9
  sed -i 's/^        for arm in ("qat", "control"):/        for arm in ("qat",):/' scripts/benchmark_throughput.py
  sed -i 's/^        if world.main:\n            write(opt, results, world.size)//' scripts/benchmark_throughput.py
  python3 - <<'PY'
p = "scripts/benchmark_throughput.py"; s = open(p).read()
s = s.replace("        if world.main:\n            write(opt, results, world.size)", "        results['control'] = results['qat']\n        if world.main:\n            write(opt, results, world.size)")
open(p, "w").write(s)
p = "models/core/distributed.py"; s = open(p).read()
s = s.replace("device.type == \"cuda\" else None, **options)", "device.type == \"cuda\" else None, **options, **__import__('json').loads(__import__('os').environ.get('DDP_EXTRA', '{}')))")
open(p, "w").write(s)
PY
  grep -n "DDP_EXTRA" models/core/distributed.py | cut -c1-80; grep -n 'for arm in ("qat",)\|results..control.. = ' scripts/benchmark_throughput.py
  nproc; lscpu | grep "Model name"; nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
go)
  setsid nohup bash /tmp/gpuS/s28b.sh chain > /tmp/tp/bg-chain.out 2>&1 < /dev/null &
  ;;
chain)
  cd /tmp/yolov9
  for r in $RUNS; do tag=g2-b64-${r%%:*}; extra=${r#*:}; mkdir -p /tmp/tp/$tag
    DDP_EXTRA=$extra torchrun --standalone --nproc_per_node 2 scripts/benchmark_throughput.py $A --out /tmp/tp/$tag \
      --device 0,1 > /tmp/tp/$tag.log 2>&1; echo "rc $? $tag $extra" >> /tmp/tp/$tag.log
  done
  ;;
wait)
  end=$(( $(date +%s) + $1 )); want=$2
  while [ $(date +%s) -lt $end ]; do
    n=$(grep -l '^rc ' /tmp/tp/*.log 2>/dev/null | wc -l); [ $n -ge $want ] && break; sleep 5
  done
  for f in /tmp/tp/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "qat:.*img/s|^rc |Error|error" "$f" | cut -c1-330 | tail -4; }; done
  tar -czf $OUT/tp.tgz -C /tmp tp
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  ;;
esac
