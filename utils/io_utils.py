"""Small helpers shared by the command-line scripts: atomic writes and the common `main()`."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: str | Path, write: Callable[[str], None], exist_ok: bool = True) -> Path:
    """Call `write(tmp_path)` on a temp file beside `path`, then rename it into place: a failure never
    leaves a half-written result. With exist_ok=False an existing file is refused."""
    path = Path(path)
    if path.exists() and not exist_ok:
        raise FileExistsError(f"{path} exists; pass --exist-ok to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def cli_main(prog: str, parse_opt: Callable, run: Callable, argv=None) -> int:
    """parse_opt() -> print_args -> run(**vars(opt)); a user error is one line on stderr and exit code 2.
    pytorch-quantization's absl logging is kept to errors."""
    from absl import logging as absl_logging
    from utils.general import LOGGER, print_args
    absl_logging.set_verbosity(absl_logging.ERROR)  # pytorch-quantization logs every quantizer state change
    opt = parse_opt(argv)
    print_args(vars(opt))
    try:
        run(**vars(opt))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        LOGGER.error(f"{prog}: error: {e}")
        return 2
    return 0
