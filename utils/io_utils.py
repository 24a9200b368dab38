"""Small helpers shared by the command-line scripts: atomic writes and the common `main()`."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from utils.interrupts import Interrupted


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask has no getter)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[str], None], exist_ok: bool = True) -> Path:
    """Call `write(tmp_path)` on a temp file beside `path`, then rename it into place: a failure never
    leaves a half-written result. With exist_ok=False an existing file is refused. The result gets the
    permissions a plain open() would give (0666 minus the umask; mkstemp makes 0600)."""
    path = Path(path)
    if path.exists() and not exist_ok:
        raise FileExistsError(f"{path} exists; pass --exist-ok to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


@dataclass(frozen=True)
class OutputDir:
    """project/name, numbered (name2, name3, ...) unless exist_ok, as upstream's runs/ folders."""
    project: str = "runs/exp"
    name: str = "exp"
    exist_ok: bool = False

    def create(self) -> Path:
        """Created only once the inputs were validated: a failed start leaves no empty folder behind."""
        from utils.general import increment_path
        save_dir = Path(increment_path(Path(self.project) / self.name, exist_ok=self.exist_ok))
        save_dir.mkdir(parents=True, exist_ok=True)
        return save_dir


def write_json(path: str | Path, obj) -> Path:
    """Atomic JSON write (temp file + rename)."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def args_line(prog: str, args: dict) -> str:
    """A run's opening line as upstream's scripts print theirs ("train: weights=..., imgsz=640"), named after the
    script. Upstream's print_args names the frame that calls it (here this module) and, to find that frame's file,
    inspects every loaded module: ~0.1 s a run once torch is imported."""
    from utils.general import colorstr
    return colorstr(f"{Path(prog).stem}: ") + ", ".join(f"{k}={v}" for k, v in args.items())


def cli_main(prog: str, parse_opt: Callable, run: Callable, argv=None, shown: Callable[..., dict] = vars) -> int:
    """parse_opt() -> the argument line of shown(opt) -> run(**vars(opt)); a user error is one line on stderr and
    exit code 2, Ctrl-C one line and exit code 130. pytorch-quantization's absl logging is kept to errors. `shown`:
    the arguments the run really takes, where they are not the parsed flags (a resumed run's own)."""
    from absl import logging as absl_logging
    from utils.general import LOGGER
    absl_logging.set_verbosity(absl_logging.ERROR)  # pytorch-quantization logs every quantizer state change
    opt = parse_opt(argv)
    LOGGER.info(args_line(prog, shown(opt)))
    try:
        run(**vars(opt))
    except (OSError, ValueError) as e:  # missing/unwritable files, bad values: the message names them
        LOGGER.error(f"{prog}: error: {e}")
        return 2
    except Interrupted as e:
        LOGGER.error(f"{prog}: {e}")
        return 130
    except KeyboardInterrupt:
        LOGGER.error(f"{prog}: interrupted")
        return 130
    return 0
