"""The console scripts' launcher (ninfer_rt.entry): a Ctrl-C while a CLI imports ends the process with 130 and
"interrupted" (no import traceback, no command run); once imported, main() gets Python's own SIGINT handler back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Run ninfer_rt.entry.launch on a module made of `body` in a fresh interpreter."""
    (tmp_path / "fake_cli.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    code = "from ninfer_rt.entry import launch; launch('fake_cli')"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.name != "posix", reason="signals to oneself")
def test_ctrl_c_while_importing_is_one_word_and_130(tmp_path):
    done = _launch(tmp_path, """
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C lands while torch imports
        time.sleep(5)
        def main():
            print("the command ran")
        """)
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", "")


@pytest.mark.skipif(os.name != "posix", reason="signals to oneself")
def test_main_runs_under_pythons_own_handler(tmp_path):
    done = _launch(tmp_path, """
        import signal
        def main():
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                print("KeyboardInterrupt reached the command")
        """)
    assert done.returncode == 0 and done.stdout == "KeyboardInterrupt reached the command\n", done.stderr


@pytest.mark.skipif(os.name != "posix", reason="signals to oneself")
@pytest.mark.parametrize("package", ["ninfer_pack", "ninfer_rt"])
def test_python_dash_m_goes_through_the_launcher(tmp_path, package):
    """`python -m PACKAGE` with a Ctrl-C while its CLI imports typer (a stand-in typer that interrupts itself)."""
    (tmp_path / "typer.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", package, "--help"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", "")
