"""INT8 quantization of reparameterized YOLOv9 / GELAN detection and segmentation models for TensorRT.

    python qat.py quantize  --weights yolov9-c-converted.pt --data data/coco.yaml   # PTQ + QAT
    python qat.py quantize  --resume runs/qat/exp                                   # continue an interrupted run
    python qat.py eval      --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --data data/coco.yaml
    python qat.py sensitive --weights yolov9-c-converted.pt --data data/coco.yaml   # per-layer sensitivity
    torchrun --nproc_per_node 2 qat.py quantize --device 0,1 --batch-size 32 ...   # several GPUs (DDP)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]
DEFAULT_HYP = "data/hyps/hyp.scratch-high.yaml"
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402

from models.core.distributed import loader_workers, world_from_env  # noqa: E402
from models.deployment.evaluate import NMSConfig  # noqa: E402
from models.finetuning.fast_step import STEP_MODES  # noqa: E402
from models.finetuning.finetune import DISTILL_TARGETS, LR_SCHEDULES, RECIPES, QATRecipe  # noqa: E402
from models.analysis import evaluate_checkpoint, sensitivity  # noqa: E402
from models.pipeline import CONTROL_PARTS, RunConfig, quantize, resume  # noqa: E402
from models.quantization.backends import BACKENDS, DEFAULT_BACKEND, get_backend  # noqa: E402
from models.quantization.quantize import CALIB_METHODS, QuantRecipe, skip_patterns  # noqa: E402
from utils.batches import CACHE_CHOICES  # noqa: E402
from utils.datasplit import SelectConfig  # noqa: E402
from utils.io_utils import OutputDir, cli_main  # noqa: E402

RESUME_KEEPS = ("device", "workers", "trust_checkpoint")  # what a resumed run takes from the new command line
QAT_FIELDS = tuple(QATRecipe.__dataclass_fields__)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def _common(p, project, weights_required=True):
    p.add_argument("--weights", type=str, required=weights_required, help="model.pt path")
    p.add_argument("--data", type=str, default=str(ROOT / "data/coco.yaml"), help="dataset.yaml path")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="cuda device, i.e. cuda:0 or cpu")
    p.add_argument("--batch-size", type=int, default=10, help="total batch size")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="train, val image size (pixels)")
    p.add_argument("--project", default=str(ROOT / project), help="save to project/name")
    p.add_argument("--name", default="exp", help="save to project/name")
    p.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")
    p.add_argument("--workers", type=int, default=None,
                   help="max dataloader workers per process (default: its share of the CPU cores, less one)")
    p.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images only")
    p.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold")
    p.add_argument("--iou-thres", type=float, default=0.7, help="NMS IoU threshold")
    p.add_argument("--seed", type=int, default=57, help="global training seed")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle --weights fully if it holds objects outside the YOLO allow-list (can run code)")


def _calibration(p, methods=CALIB_METHODS, default="auto"):
    p.add_argument("--hyp", type=str, default=str(ROOT / DEFAULT_HYP), help="hyperparameters path")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND,
                   help="quantization library: pytorch-quantization, or NVIDIA Model Optimizer (modelopt: "
                        "./install_dependencies.sh --modelopt); eval and export read it from the checkpoint")
    p.add_argument("--calib-method", choices=methods, default=default,
                   help="activation amax: auto (every method below from one pass of statistics, the best on the "
                        "select split kept), or max, or from a histogram by mse / percentile / entropy")
    p.add_argument("--calib-batches", type=int, default=25, help="batches of training images used for calibration")
    p.add_argument("--percentile", type=float, default=99.999, help="percentile for --calib-method percentile")


def _select_flags(q):
    q.add_argument("--select-fraction", type=float, default=0.1,
                   help="share of the training images held out to choose on (calibration method, delivered model)")
    q.add_argument("--select-min", type=int, default=100,
                   help="hold out at least this many images, while at least half of the training images remain")
    q.add_argument("--select-data", type=str, default=None,
                   help="dataset.yaml whose val images are the select split (the training images are not split)")
    q.add_argument("--no-select", action="store_true",
                   help="choose on the val images instead (their mAP is then optimistic; warned)")


def _mixed_flags(q):
    q.add_argument("--max-loss", type=float, default=None, metavar="MAP",
                   help="mixed precision: keep INT8 tensors in float (FP16 in TensorRT), the fewest FLOPs first, until "
                        "PTQ is within MAP (mAP50-95) of the float model on select, then fine-tune; default: all INT8")


def _run_flags(q):
    q.add_argument("--iters", type=int, default=200, help="QAT iterations per epoch (0: one pass over the images)")
    q.add_argument("--epochs", type=int, default=10, help="QAT epochs (0: PTQ only)")
    q.add_argument("--cache", type=str, nargs="?", const="ram", default="auto", choices=CACHE_CHOICES,
                   help="the fine-tuning images decoded once, kept in RAM (or .npy files on disk), as upstream's "
                        "--cache: the same pixels, less CPU per step; auto: in RAM on a CUDA GPU where this machine's "
                        "processes' copies fit in half the free RAM (the log says which and why); off: never")
    q.add_argument("--step", choices=STEP_MODES, default="auto",
                   help="the fine-tuning step: auto compiles it on a CUDA GPU where the planned iterations repay the "
                        "compile (channels-last, CUDA graphs; the log says which and why), inductor or cudagraphs "
                        "compile it with that torch.compile backend, eager runs it op by op")
    q.add_argument("--skip-layers", nargs="*", default=[], help="layer indices or module-name regexes kept in float")
    q.add_argument("--no-eval-origin", action="store_true", help="do not evaluate the float model")
    q.add_argument("--no-eval-ptq", action="store_true", help="do not evaluate the PTQ model")
    q.add_argument("--resume", type=str, default=None, metavar="RUN_DIR",
                   help="continue an interrupted run from its last completed stage (its own settings are used)")


def _recipe_flags(q):
    q.add_argument("--recipe", choices=sorted(RECIPES), default="default",
                   help="QAT preset: default (measured best, docs/RESULTS.md) or reference (per-layer MSE, Adam 1e-5); "
                        "the flags below override single fields")
    q.add_argument("--distill", choices=DISTILL_TARGETS, default=None,
                   help="distillation target: head outputs, every layer's output (MSE), or none")
    q.add_argument("--supervision-stride", type=int, default=None, help="--distill layers: every N-th layer")
    q.add_argument("--det-loss", type=float, default=None, help="weight of the detection loss on labels (0: off)")
    q.add_argument("--lr", type=float, default=None, help="peak QAT learning rate (Adam)")
    q.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                   help="cosine (warm-up + cosine decay per iteration) or step (the reference's)")
    q.add_argument("--learn-amax", action=argparse.BooleanOptionalAction, default=None,
                   help="train the activation ranges (amax) too")
    q.add_argument("--ema", type=float, default=None, help="weight EMA decay (0: off)")
    q.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="segmentation: train on one mask per image (--overlap, upstream's default) or on every "
                        "instance's full mask (--no-overlap); default: as the float model was trained (its "
                        "checkpoint's opt.no_overlap), else --overlap")


def _measurement_flags(q):
    q.add_argument("--float-control", nargs="?", const="all", choices=CONTROL_PARTS, default=None,
                   help="the float control of a QAT run: the same fine-tune with every quantizer disabled, or "
                        "only the weight or only the activation quantizers")
    q.add_argument("--float-epochs", type=int, default=0,
                   help="the first N of --epochs fine-tune in float (one learning-rate schedule), then the ranges are "
                        "calibrated anew and QAT continues from that PTQ model")
    q.add_argument("--save-candidates", action="store_true",
                   help="also save each calibration candidate's PTQ model (weights/ptq_<candidate>_<stem>.pt), as "
                        "measured on select, to measure it on other images")
    q.add_argument("--no-share-rules", action="store_true",
                   help="no TensorRT scale sharing (the export gets reformat layers in TensorRT)")


def parse_opt(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("quantize", help="insert quantizers, calibrate (PTQ), fine-tune (QAT), save the best")
    run = q.add_argument_group("run")
    _common(run, "runs/qat", weights_required=False)
    _run_flags(run)
    choose = q.add_argument_group("calibration and selection (every choice is made on the select split)")
    _calibration(choose)
    _select_flags(choose)
    _mixed_flags(choose)
    _recipe_flags(q.add_argument_group("fine-tuning recipe"))
    _measurement_flags(q.add_argument_group("measurement only (what the benchmark compares; not for deployment)"))

    s = sub.add_parser("sensitive", help="per-layer quantization sensitivity of a float model")
    _common(s, "runs/qat_sensitive")
    _calibration(s, methods=CALIB_METHODS[1:], default="mse")
    _select_flags(s)

    e = sub.add_parser("eval", help="evaluate a quantized checkpoint")
    _common(e, "runs/qat_eval")
    opt = parser.parse_args(argv)
    opt.workers = loader_workers(opt.workers, world_from_env())
    _check(parser, opt)
    return opt


def _check(parser, opt):
    if opt.cmd == "quantize" and not (opt.weights or opt.resume):
        parser.error("--weights is required (or --resume RUN_DIR)")
    if opt.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {opt.batch_size}")
    if opt.workers < 0:
        parser.error(f"--workers must be >= 0, got {opt.workers}")
    if opt.imgsz < 32 or opt.imgsz % 32:
        parser.error(f"--imgsz must be a multiple of 32 (>= 32), got {opt.imgsz}")
    if opt.num_image is not None and opt.num_image < 1:
        parser.error(f"--num-image must be >= 1, got {opt.num_image}")
    if opt.cmd == "quantize" and opt.resume:
        return
    try:
        build(dict(vars(opt)))
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def build(flags: dict) -> tuple[str, RunConfig, OutputDir, list[str]]:
    """The command, its frozen configuration, the output folder and the --skip-layers values, from the parsed
    flags. Every flag must be consumed: a flag nothing reads is a bug, not something to ignore."""
    cmd = flags.pop("cmd")
    out = OutputDir(flags.pop("project"), flags.pop("name"), flags.pop("exist_ok"))
    skip = [str(v) for v in flags.pop("skip_layers", [])]
    quant = QuantRecipe(backend=flags.pop("backend", DEFAULT_BACKEND), calib_method=flags.pop("calib_method", "auto"),
                        percentile=flags.pop("percentile", 99.999), calib_batches=flags.pop("calib_batches", 25),
                        skip=skip_patterns(skip),
                        share_rules=not flags.pop("no_share_rules", False))
    if cmd != "eval":
        try:  # its library imports, or a one-line error before anything is written
            get_backend(quant.backend)
        except ValueError as e:
            raise ValueError(f"--backend {quant.backend}: {e}") from None
    preset = flags.pop("recipe", "default")
    qat = RECIPES[preset].with_overrides(**{k: flags.pop(k, None) for k in QAT_FIELDS})
    nms = NMSConfig(conf_thres=flags.pop("conf_thres"), iou_thres=flags.pop("iou_thres"))
    flags.pop("resume", None)
    select = SelectConfig(fraction=flags.pop("select_fraction", 0.1), min_images=flags.pop("select_min", 100),
                          data=flags.pop("select_data", None), enabled=not flags.pop("no_select", False))
    cfg = RunConfig(quant=quant, qat=qat, nms=nms, select=select, epochs=flags.pop("epochs", 0), iters=flags.pop("iters", 0),
                    control=flags.pop("float_control", None) or "", max_loss=flags.pop("max_loss", None),
                    eval_origin=not flags.pop("no_eval_origin", False),
                    eval_ptq=not flags.pop("no_eval_ptq", False), save_candidates=flags.pop("save_candidates", False),
                    hyp=flags.pop("hyp", str(ROOT / DEFAULT_HYP)),
                    **flags)
    return cmd, cfg, out, skip


def run(**flags) -> dict:
    if flags.get("resume"):
        return resume(flags["resume"], **{k: flags[k] for k in RESUME_KEEPS})
    cmd, cfg, out, skip = build(flags)
    if cmd == "quantize":
        return quantize(cfg, out, skip)
    return {"eval": evaluate_checkpoint, "sensitive": sensitivity}[cmd](cfg, out)


def shown_args(opt) -> dict:
    """What a command runs with, for its first line: a resumed run's own settings (its report.json's configuration)
    with what the new command line changes (RESUME_KEEPS), not the parser's defaults it does not use."""
    flags = vars(opt)
    report = Path(opt.resume) / "report.json" if opt.cmd == "quantize" and opt.resume else None
    if report is None:
        return flags
    try:
        config = json.loads(report.read_text())["config"]
    except (OSError, ValueError, KeyError):  # resume() names what is wrong with the folder
        return {"resume": opt.resume}
    return {"resume": opt.resume, **config, **{k: flags[k] for k in RESUME_KEEPS}}


def main(argv=None) -> int:
    return cli_main("qat.py", parse_opt, run, argv, shown_args)


if __name__ == "__main__":
    sys.exit(main())
