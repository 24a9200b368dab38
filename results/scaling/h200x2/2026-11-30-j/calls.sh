#!/usr/bin/env bash
# GPU calls for session 27 (issue 68), nvidia-h200-x2:
# 1 carry [".gpu/stage", ".gpu/f5", ".gpu/run"]: bash .gpu/run/s27.sh stage && bash /tmp/gpuS/s27.sh imports
# 2 carry [".gpu/m3"]: cp .gpu/m3/* /tmp/      3 carry [".gpu/m4"]: cp .gpu/m4/* /tmp/ && bash /tmp/gpuS/s27.sh go
# 4 bash /tmp/gpuS/s27.sh wait 560 'pair' 1   5 bash /tmp/gpuS/s27.sh wait 560 'prof-*' 1
# second lease (6d187da, the upsampling rewrite): 1 as above + bench; 2, 3 as above; 4 wait 'prof-*' then 'pair'
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/ipython-shim Y9=/tmp/yolov9
# the lent machine's packages have no bytecode cache and a read-only site-packages (every run compiled ~1,800
# modules from source, 2026-11-30-i): a pip-installed environment has one; the runs read theirs from here
export PYTHONPYCACHEPREFIX=/tmp/pyc
IMPORTS="import torch, torch._dynamo, torch._inductor.compile_fx, torch._functorch.aot_autograd, torchvision, cv2, onnx, onnxruntime, pytorch_quantization, models.pipeline"
cmd=$1; shift
case $cmd in
stage)
  . .gpu/stage/stage.sh .gpu/f5
  mkdir -p /tmp/gpuS /tmp/tp/pair && cp -r .gpu/run/* /tmp/gpuS/
  git log --oneline -1; git status --short | head -3
  bash patch_yolov9.sh /tmp/yolov9 > /dev/null && cat /tmp/yolov9/.yolov9_qat_commit
  nproc; lscpu | grep "Model name"; nvidia-smi --query-gpu=name,memory.used --format=csv
  ;;
imports)  # first lease only
  cd /tmp/yolov9
  for i in cold warm warm; do  # the imports of a run: without, then with the bytecode cache
    s=$(date +%s.%N); python3 -c "$IMPORTS" 2>/dev/null; e=$(date +%s.%N)
    echo "imports $i: $(python3 -c "print(round($e - $s, 1))") s" | tee -a /tmp/tp/imports.log
  done
  ;;
go)
  cat /tmp/gc.00 /tmp/gc.01 > /tmp/gelan-c-helmet.pt && sha256sum /tmp/gelan-c-helmet.pt | cut -c1-16
  setsid nohup bash /tmp/gpuS/s27.sh chain > /tmp/tp/bg-chain.out 2>&1 < /dev/null &
  ;;
chain)  # one job at a time
  bash /tmp/gpuS/s27.sh prof; bash /tmp/gpuS/s27.sh pair
  ;;
bench)
  cd /tmp/yolov9 && python3 /tmp/gpuS/poolbench.py 2>&1 | tee /tmp/tp/poolbench.log
  ;;
pair)  # the README default (batch 10, 10 x 200 iterations) on gelan-c 640: auto and eager at once, one GPU each
  cd /tmp/yolov9
  python3 scripts/benchmark_step.py --weights /tmp/gelan-c-helmet.pt --data /tmp/helmet-416/data.yaml --imgsz 640 \
    --seeds 57 --steps auto eager --devices 0 1 --project /tmp/pair --out /tmp/tp/pair/gelan-c-helmet-640-pair.json \
    -- --workers 15 > /tmp/tp/pair.log 2>&1; echo "rc $? pair" >> /tmp/tp/pair.log
  ;;
prof)  # the README default's step (batch 10, cudagraphs) under torch.profiler: where its GPU time goes
  tag=prof-gelan-c-cudagraphs-b10; mkdir -p /tmp/tp/$tag; cd /tmp/yolov9
  CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark_throughput.py --cfg models/detect/gelan-c.yaml \
    --data /tmp/helmet-416/data.yaml --imgsz 640 --cache ram --step cudagraphs --batch-size 10 --workers 15 \
    --loader-batches 0 --warmup 10 --steps 60 --breakdown-steps 10 --profile-steps 10 --out /tmp/tp/$tag \
    --device 0 > /tmp/tp/$tag.log 2>&1; echo "rc $? $tag" >> /tmp/tp/$tag.log
  ;;
seeds)
  cp assets/gelan-s-helmet.pt /tmp/ && cd /tmp/yolov9 && mkdir -p /tmp/tp/seeds
  python3 scripts/benchmark_step.py --weights /tmp/gelan-s-helmet.pt --data /tmp/helmet-416/data.yaml --imgsz 416 \
    --seeds 0 1 2 --steps auto --devices 0 1 --project /tmp/step --out /tmp/tp/seeds/gelan-s-helmet-416-auto.json \
    -- --workers 10 > /tmp/tp/seeds.log 2>&1; echo "rc $? seeds" >> /tmp/tp/seeds.log
  mkdir -p /tmp/tp/seeds/runs; cp /tmp/step/*.log /tmp/tp/seeds/runs/ 2>/dev/null
  for r in /tmp/step/*/; do [ -f "$r/report.json" ] && cp $r/report.json /tmp/tp/seeds/runs/$(basename $r).report.json; done
  tail -8 /tmp/tp/seeds.log | cut -c1-300; tar -czf $OUT/seeds.tgz -C /tmp/tp seeds seeds.log
  ;;
wait)  # wait SECONDS PATTERN N: until N files /tmp/tp/PATTERN.log each have an rc line, or SECONDS
  end=$(( $(date +%s) + $1 )); pat=$2; want=$3
  while [ $(date +%s) -lt $end ]; do
    n=0; for f in /tmp/tp/$pat.log; do [ -f "$f" ] && grep -q '^rc ' "$f" && n=$((n+1)); done
    [ $n -ge $want ] && break; sleep 5
  done
  for f in /tmp/tp/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "img/s|rc |Error|error|wall|imports" "$f" | tail -6; }; done
  mkdir -p /tmp/tp/runs; cp /tmp/pair/*.log /tmp/tp/runs/ 2>/dev/null  # at most 8 files come back: one archive
  for r in /tmp/pair/*/; do [ -f "$r/report.json" ] && cp $r/report.json /tmp/tp/runs/$(basename $r).report.json; done
  tar -czf $OUT/tp.tgz -C /tmp tp
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  ;;
esac
# third lease (d097458): gelan-s on helmet at 416, the default auto, seeds 0-2 on two GPUs (the accuracy goal of issue
# 68 with the upsampling rewrite): bash .gpu/run/s27.sh stage && bash /tmp/gpuS/s27.sh seeds
