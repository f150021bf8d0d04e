"""What both CLIs share: the error-to-exit-code contract and human-readable sizes."""

from __future__ import annotations

import signal
import sys
import threading

import typer
from rich.console import Console
from rich.text import Text

from ninfer_rt.errors import NinferError


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C (a BaseException, so no `except Exception` on the way stops
    it), and open outputs are removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum, _frame) -> None:
    raise Terminated(signum)


def _usage_error(e: Exception) -> bool:
    """Click's usage errors (a bad or missing option, an unknown command), whichever click typer brings."""
    return type(e).__module__.endswith("click.exceptions") and hasattr(e, "format_message")


def plain_console(stderr: bool = False) -> Console:
    """A console that prints strings as written. Paths, recipe names and messages carry user text, so no rich
    markup or emoji code is read in them (a `[/red]` in a file name would raise, `[b]` would vanish)."""
    return Console(stderr=stderr, markup=False, emoji=False)


def labelled(label: str, style: str, text: str) -> Text:
    """`label text` with the label styled and the text literal (for plain consoles)."""
    return Text.assemble((label, style), " ", text)


def run_app(app: typer.Typer, err: Console) -> None:
    """Run a Typer app. Every user error ends as one line on stderr and a non-zero exit: a NinferError or an OS
    error (disk full, a name too long) `error: ...`, exit 1; a usage error `error: ... (see --help)`, exit 2;
    Ctrl-C exits 130, SIGTERM 143, SIGHUP 129, each after the cleanups of what was being written."""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only there can Python handle signals
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):  # no SIGHUP on Windows
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's ignore stays
                previous[sig] = signal.signal(sig, _terminate)

    def fail(message: str, code: int) -> None:
        sys.stdout.flush()  # what was already streamed stays ahead of the error
        err.print(labelled("error:", "red", message), highlight=False, soft_wrap=True)
        sys.exit(code)

    try:
        code = app(standalone_mode=False)
    except NinferError as e:
        fail(str(e), 1)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        fail(f"{e.strerror or str(e) or type(e).__name__}{where}", 1)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Terminated as e:
        err.print(f"terminated ({e})")
        sys.exit(128 + e.signum)
    except Exception as e:
        if type(e).__name__ == "Abort" and type(e).__module__.endswith(("click.exceptions", "typer.exceptions")):
            err.print("interrupted")  # click (before typer's own main) turns Ctrl-C or EOF into Abort
            sys.exit(130)
        if not _usage_error(e):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # no arguments: the help, as click prints it
            print(e.format_message())
            sys.exit(2)
        fail(f"{e.format_message()} (see --help)".replace("\n", " "), getattr(e, "exit_code", 2))
    finally:  # an embedding process (a test run) gets its own handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 130:  # click (non-standalone) turns a real Ctrl-C into Abort and returns 130 after the cleanups
        err.print("interrupted")
    sys.exit(code if isinstance(code, int) else 0)


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
