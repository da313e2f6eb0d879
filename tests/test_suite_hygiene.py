"""The suite itself: no test can hang CI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_every_test_has_a_timeout(pytestconfig: pytest.Config) -> None:
    assert int(pytestconfig.getini("timeout")) > 0
    assert pytestconfig.getini("timeout_method") == "thread"


def test_a_hanging_test_is_stopped(tmp_path: Path) -> None:
    hang = tmp_path / "test_hang.py"
    hang.write_text("import threading\n\ndef test_hang():\n    threading.Event().wait()\n")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=1",
                          "-o", "timeout_method=thread", str(hang)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode != 0
    assert "Timeout" in run.stdout + run.stderr
    assert time.monotonic() - start < 30
