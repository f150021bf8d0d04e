"""The console scripts' entry points. Importing a CLI takes up to a second or more (typer, rich, torch); a Ctrl-C
in that window ends the process with 130 and one word, as one during a command does, not an import traceback.
Nothing has been written before the command runs, so ending at once loses nothing."""

from __future__ import annotations

import importlib
import os
import signal
import sys


def _interrupted_while_importing(signum, frame) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)  # not an exception: an import machinery callback would swallow one and the command would run


def launch(module: str) -> None:
    """Import `module` under the handler above, then run its main() with Python's own SIGINT handler back (the
    command turns KeyboardInterrupt into its cleanups and 130)."""
    previous = signal.signal(signal.SIGINT, _interrupted_while_importing)
    try:
        main = importlib.import_module(module).main
    finally:
        signal.signal(signal.SIGINT, previous)
    main()


def rt() -> None:
    """ninfer-rt"""
    launch("ninfer_rt.cli")
