"""The planner stands on data shipped in the package, not on the bench or the repository's benchmarks/results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvshuttle.planner.validate import default_e2e_path, default_transfer_paths, measured_path
from kvshuttle.planner.validate_placement import BLOCK, default_placement_path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SHIPPED = ("vm2_e2e.json", "vm2_e2e_layered.json", "vm2_placement.json", "vm2old_transfer.json",
           "vm2old_transfer_1536.json")


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_measurements_are_the_committed_runs(name: str) -> None:
    """A run re-measured in benchmarks/results/ must be copied to python/kvshuttle/planner/data/validation/."""
    committed = RESULTS / name
    if not committed.is_file():
        pytest.skip("no repository checkout next to the tests")
    assert measured_path(name).read_bytes() == committed.read_bytes(), \
        f"copy benchmarks/results/{name} to python/kvshuttle/planner/data/validation/"


def test_the_defaults_are_inside_the_package() -> None:
    package = Path(measured_path("vm2_e2e.json")).parents[2]
    assert package.name == "planner"
    for path in (default_e2e_path(), default_placement_path(), *default_transfer_paths(default_e2e_path())):
        assert package in path.parents
    assert len(default_transfer_paths(default_placement_path())) == 2


def test_the_placement_block_size_is_the_benchs() -> None:
    from kvshuttle.bench.e2e.placement import BLOCK as BENCH_BLOCK

    assert BLOCK == BENCH_BLOCK


def test_validation_imports_no_bench() -> None:
    code = """
import sys
import kvshuttle.planner.validate, kvshuttle.planner.validate_placement
assert not [m for m in sys.modules if m.startswith("kvshuttle.bench")], "the planner imported the bench layer"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
