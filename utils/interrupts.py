"""Ctrl-C in a long run, acted on between steps.

Inside `StopBetweenSteps`, the first Ctrl-C (SIGINT) is noted and the run stops where it next asks (`check`, or the
next item of a loop wrapped in `between`): before a batch, a training step or an evaluation, never inside one. What
was under way is then finished (a checkpoint being written, a progress bar being drawn: tqdm 4.67 leaves a bar
interrupted in its constructor to a finaliser that prints a traceback, tqdm/tqdm#1537). A second Ctrl-C stops at once.

What invalidates it: nothing outlives the `with` block; the previous SIGINT handler is put back on leaving it and at
the first Ctrl-C. It takes SIGINT only where Python's own handler has it (the main thread, Ctrl-C not ignored)."""
from __future__ import annotations

import signal
import sys
import threading
from typing import Iterable, Iterator


class Interrupted(Exception):
    """Ctrl-C during a run, with what to do next (how to resume)."""


class StopBetweenSteps:
    """See the module docstring. `requested`: a Ctrl-C came and has not yet been acted on."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StopBetweenSteps":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _note(self, signum, frame) -> None:
        self.requested = True
        self._restore()
        sys.stderr.write("\nCtrl-C: stopping before the next step (Ctrl-C again to stop now)\n")

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def check(self) -> None:
        """KeyboardInterrupt if a Ctrl-C came: the caller is where stopping leaves nothing half-done."""
        if self.requested:
            self.requested = False
            raise KeyboardInterrupt

    def between(self, items: Iterable) -> "Checked":
        """`items`, checked before each one is taken (a loader keeps its length, for progress bars)."""
        return Checked(items, self)


class Checked:
    """An iterable that calls `stop.check()` before taking each item; len() is the wrapped one's."""

    def __init__(self, items: Iterable, stop: StopBetweenSteps):
        self.items, self.stop = items, stop

    def __iter__(self) -> Iterator:
        self.stop.check()
        for item in self.items:
            yield item
            self.stop.check()

    def __len__(self) -> int:
        return len(self.items)
