#!/usr/bin/env bash
# The calls of this folder, as run (session 29, one nvidia-h200-x2 lease). Staged with .gpu/stage/stage.sh as in
# ../2026-11-30-l/calls.sh; /tmp/yolov9 is the checkout patched at 9479bc0.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/ipython-shim PYTHONPYCACHEPREFIX=/tmp/pyc
cd /tmp/yolov9

# 1. Throughput, one GPU at batch 64 against two at global 64, alternating (g2-a, g1-a, g2-b, g1-b), one at a time.
# Device-only edit of scripts/benchmark_throughput.py: the QAT arm alone (its control entry a copy of it).
sed -i 's/^        for arm in ("qat", "control"):/        for arm in ("qat",):/' scripts/benchmark_throughput.py
python3 - <<'PY'
p = "scripts/benchmark_throughput.py"; s = open(p).read()
s = s.replace("        if world.main:\n            write(opt, results, world.size)",
              "        results['control'] = results['qat']\n        if world.main:\n            write(opt, results, world.size)")
open(p, "w").write(s)
PY
A="--cfg models/detect/gelan-c.yaml --data /tmp/helmet-416/data.yaml --imgsz 640 --cache ram --step inductor
   --loader-batches 0 --warmup 15 --steps 60 --breakdown-steps 5 --batch-size 64"
for r in g2-a g1-a g2-b g1-b; do tag=$r-b64
  case $r in
  g2*) torchrun --standalone --nproc_per_node 2 scripts/benchmark_throughput.py $A --out /tmp/tp/$tag --device 0,1 \
         > /tmp/tp/$tag.log 2>&1;;
  g1*) python3 scripts/benchmark_throughput.py $A --out /tmp/tp/$tag --device 0 > /tmp/tp/$tag.log 2>&1;;
  esac; echo "rc $? $tag" >> /tmp/tp/$tag.log
done

# 2. The README's "Several GPUs" command and its one-process twin, started together (GPUs 0,1 and GPU 1), per seed
# (seed 57's project was /tmp/acc).
for seed in 57 58 59; do
  Q="--weights /tmp/gelan-c-helmet.pt --data /tmp/helmet-416/data.yaml --imgsz 416 --batch-size 32 --epochs 2 --iters 0
     --seed $seed --project /tmp/acc$seed --exist-ok"
  torchrun --standalone --nproc_per_node 2 qat.py quantize $Q --device 0,1 --name g2 > acc/seed$seed-g2.log 2>&1 &
  python3 qat.py quantize $Q --device 1 --name g1 > acc/seed$seed-g1.log 2>&1
  wait
done

# 3. Seed 59's calibration again with every candidate saved (PTQ only), then one process at 16 images a batch.
C="--weights /tmp/gelan-c-helmet.pt --data /tmp/helmet-416/data.yaml --imgsz 416 --epochs 0 --save-candidates
   --no-eval-origin --seed 59 --project /tmp/cal59 --exist-ok"
torchrun --standalone --nproc_per_node 2 qat.py quantize $C --batch-size 32 --device 0,1 --name g2 > acc/cal59-g2.log 2>&1 &
python3 qat.py quantize $C --batch-size 32 --device 1 --name g1 > acc/cal59-g1.log 2>&1; wait
python3 qat.py quantize $C --batch-size 16 --device 0 --name g1b16 > acc/cal59-g1b16.log 2>&1
# The input quantizers' amax of two candidate files compared (the README's table "ranges"):
python3 - <<'PY'
import glob, torch
def amax(p):
    ck = torch.load(p, map_location="cpu", weights_only=False)
    m = ck["model"] if isinstance(ck, dict) else ck
    return {n: b.float() for n, b in m.named_buffers() if n.endswith("_amax")}
def compare(tag, f1, f2):
    a, b = amax(f1), amax(f2)
    inputs = [k for k in a if "input" in k]
    rel = sorted(((a[k] - b[k]).abs() / b[k].abs().clamp_min(1e-12)).max().item() for k in inputs)
    weights = max(((a[k] - b[k]).abs() / b[k].abs().clamp_min(1e-12)).max().item() for k in a if k not in inputs)
    print(tag, len(inputs), "input rel diff: n>0", sum(r > 0 for r in rel), "max", rel[-1], "weights max", weights)
for c in ("max", "mse", "percentile-99.99_", "percentile-99.999", "entropy"):
    compare(c, *(glob.glob(f"/tmp/cal59/{r}/weights/ptq_{c}*")[0] for r in ("g1", "g2")))
compare("seed 57 delivered ptq (mse)", glob.glob("/tmp/acc/g1/weights/ptq_*")[0], glob.glob("/tmp/acc/g2/weights/ptq_*")[0])
PY
