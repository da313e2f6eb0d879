"""Collect the ``bench_*.py`` files of this folder, so ``pytest benchmarks --benchmark-enable`` runs them.

pyproject keeps ``testpaths = ["tests"]`` and ``python_files`` at pytest's default (``test_*.py``): plain ``pytest``
(the CI command) never enters this folder, and without ``--benchmark-enable`` (pyproject's ``addopts`` has
``--benchmark-disable``) each case runs its function once, as a smoke test of what it would time.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
        return module
    return None
