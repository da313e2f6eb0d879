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


def test_no_statement_hides_after_the_raising_call() -> None:
    """Inside ``pytest.raises`` only one statement, and not an ``assert``: anything after the call that raises
    never runs, and an assert around it never checks, so either would pass whether it holds or not."""
    import ast

    offenders = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.With) and (len(node.body) > 1 or isinstance(node.body[0], ast.Assert)) and any(
                    isinstance(item.context_expr, ast.Call)
                    and getattr(item.context_expr.func, "attr", "") == "raises" for item in node.items):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test files by basename (no packages here): a module in tests/ and one in tests/e2e/ with the
    same name stop the whole run at collection."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        if path.name in seen and path.name not in ("__init__.py", "conftest.py"):
            clashes.append(f"{seen[path.name]} and {path}")
        seen.setdefault(path.name, path)
    assert not clashes, clashes
