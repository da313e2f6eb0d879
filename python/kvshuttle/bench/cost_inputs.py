"""The policy's cost-model inputs from ``kvshuttle bench transfer --json`` output, under the bench's name.

They are parsed by :mod:`kvshuttle.planner.transfer_costs` (the planner validates itself on shipped
measurements without the bench: the bench builds on the planner, not the reverse).

    inputs = cost_inputs_from_bench(["benchmarks/results/vm5_transfer.json",
                                     "benchmarks/results/vm5_transfer_1536.json"], shape="qwen3-32b-tp1")
    config = PolicyConfig(kind="cost", prefill_tokens_per_s=..., **inputs)
"""

from __future__ import annotations

from ..planner.transfer_costs import (
    TRANSFER_METHODS,
    BenchFormatError,
    BenchSource,
    cost_inputs_from_bench,
    load_transfer_results,
)

__all__ = ["TRANSFER_METHODS", "BenchFormatError", "BenchSource", "cost_inputs_from_bench", "load_transfer_results"]
