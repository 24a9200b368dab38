"""On a GPU: the detection loss of fine-tuning against upstream's, under AMP as the step runs it: same value,
no synchronisation (torch.cuda.set_sync_debug_mode), host and device time per call. gelan-c, 640, batch 32."""
import json, sys, time, yaml, torch
sys.path.insert(0, "/tmp/yolov9")
from models.yolo import Model
from utils.loss_tal import ComputeLoss
from models.core.sync_free_loss import DetectionLoss, with_padded_targets
torch.manual_seed(0)
dev = torch.device("cuda:0")
m = Model("/tmp/yolov9/models/detect/gelan-c.yaml", nc=11).to(dev).train()
m.hyp = yaml.safe_load(open("/tmp/yolov9/data/hyps/hyp.scratch-high.yaml"))
b = 32
g = torch.Generator().manual_seed(0)
n = 12 * b
t = torch.cat([torch.randint(0, b, (n, 1), generator=g).float(), torch.randint(0, 11, (n, 1), generator=g).float(),
               torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.3 + 0.02], 1).pin_memory()
x = torch.rand(b, 3, 640, 640, device=dev)
with torch.autocast("cuda", dtype=torch.float16):
    maps = [o.detach() for o in m(x)]
out = {}
for name, loss in (("upstream", with_padded_targets(ComputeLoss)(m)), ("sync_free", DetectionLoss(m))):
    vals = []
    for i in range(25):
        leaves = [o.clone().requires_grad_(True) for o in maps]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if name == "sync_free" and i >= 5:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.float16):
                tt = t if name == "sync_free" else t.to(dev)
                v, parts = loss(leaves, tt)
            v.backward()
        except RuntimeError as e:
            out.setdefault(name + "_sync_error", str(e)[:300])
            torch.cuda.set_sync_debug_mode(0)
            break
        finally:
            torch.cuda.set_sync_debug_mode(0)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        if i >= 5:
            vals.append((host, total))
    out[name] = {"loss": float(v), "parts": parts.tolist(), "grad0_sum": float(leaves[0].grad.float().abs().sum()),
                 "host_ms": round(1e3 * sorted(h for h, _ in vals)[len(vals) // 2], 2) if vals else None,
                 "total_ms": round(1e3 * sorted(t_ for _, t_ in vals)[len(vals) // 2], 2) if vals else None}
out["torch"] = torch.__version__
print(json.dumps(out, indent=1))
