"""Run a CLI in-process through its real entry point (main), as a user would from the shell."""

from __future__ import annotations

import sys


def run_main(main, prog: str, args, capsys) -> tuple[int, str, str]:
    """`prog ARGS` through main(); returns (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = [prog, *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    o = capsys.readouterr()
    return code, o.out, o.err


def error_line(err: str) -> str:
    """The single `error: ...` line a user error must produce (no traceback, nothing else on stderr after it)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def one_line(e) -> str:
    """The message of a raised error (pytest.ExceptionInfo): it must be one non-empty line."""
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg
