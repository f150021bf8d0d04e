"""What both CLIs share: the error-to-exit-code contract and human-readable sizes."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from ninfer_rt.errors import NinferError


def run_app(app: typer.Typer, err: Console) -> None:
    """Run a Typer app: a NinferError becomes `error: <one line>` on stderr and exit 1; Ctrl-C exits 130."""
    try:
        app()
    except NinferError as e:
        sys.stdout.flush()  # what was already streamed stays ahead of the error
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True, emoji=False)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; binary units, as GPU memory is counted."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: float) -> str:
    """35951822704 -> '35.95 B'."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return str(int(n))
