"""The policy's cost-model inputs from ``kvshuttle bench transfer --json`` output: the read's bytes per token,
bandwidth and per-read overhead (the policy only defines :class:`~kvshuttle.policy.CostInputs`).

Here, in the planner, because the planner validates itself on shipped measurements (``data/validation/``)
without the bench; :mod:`kvshuttle.bench.cost_inputs` is the bench's name for the same functions.

    inputs = cost_inputs_from_bench(["benchmarks/results/vm5_transfer.json",
                                     "benchmarks/results/vm5_transfer_1536.json"], shape="qwen3-32b-tp1")
    config = PolicyConfig(kind="cost", prefill_tokens_per_s=..., **inputs)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..policy.decision import CostInputs, PolicyError

TRANSFER_METHODS = ("direct", "direct_prepped", "packed")  # what the engine can use (raw_per_block is vLLM's)
BenchSource = Mapping[str, Any] | str | os.PathLike[str]


class BenchFormatError(PolicyError):
    """Not usable ``kvshuttle bench transfer --json`` output, or no result matches what was asked."""


def load_transfer_results(bench: BenchSource | Sequence[BenchSource]) -> list[Mapping[str, Any]]:
    """The ``results`` rows of one or more transfer bench outputs (dicts, or paths to JSON files)."""
    sources = list(bench) if isinstance(bench, Sequence) and not isinstance(bench, str) else [bench]
    results: list[Mapping[str, Any]] = []
    for source in sources:
        if isinstance(source, Mapping):
            data: Any = source
        else:
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
        if not isinstance(data, Mapping) or data.get("bench") != "transfer" or not isinstance(
                data.get("results"), list):
            raise BenchFormatError("expected the output of 'kvshuttle bench transfer --json' "
                                   "({'bench': 'transfer', 'results': [...]})")
        results.extend(data["results"])
    return results


def _seconds(row: Mapping[str, Any], method: str) -> float:
    """Median seconds of one read by ``method``: ``seconds`` (schema 1), else from ``gbps`` (older output)."""
    seconds = row.get("seconds", {}).get(method)
    if seconds:
        return float(seconds)
    rate = float(row["gbps"].get(method, 0.0))
    return float(row["bytes"]) / (rate * 1e9) if rate > 0 else 0.0


def cost_inputs_from_bench(bench: BenchSource | Sequence[BenchSource], *, shape: str | None = None,
                           pattern: str = "scattered", method: str = "best", block_size: int = 16,
                           transfer_overhead_s: float | None = None) -> CostInputs:
    """Cost-model inputs from ``kvshuttle bench transfer --json`` output (dicts, or paths to JSON files).

    * ``kv_bytes_per_token``: bytes read / tokens read, scaled from the layers the bench allocated to the
      model's (``layers_in_model / layers``); ``block_size`` tokens per block when a result does not say.
    * ``bandwidth_bytes_per_s``: of ``method`` (``"best"``: the fastest of direct / direct_prepped / packed on
      the largest read, as the engine picks its path) for ``pattern`` (``scattered`` block ids are what a
      long-running server has; ``contiguous`` is the best case).
    * ``transfer_overhead_s``: given, else fitted with bandwidth as ``t = overhead + bytes / bandwidth`` when
      the results hold reads of two or more sizes (run the bench with a small ``--blocks`` too), else 0.

    Every row of the shape and pattern counts (a chunk sweep's rows too). Raises :class:`BenchFormatError`.
    """
    rows = [r for r in load_transfer_results(bench) if r.get("pattern") == pattern]
    shapes = sorted({str(r.get("shape")) for r in rows})
    if shape is None and len(shapes) == 1:
        shape = shapes[0]
    rows = [r for r in rows if r.get("shape") == shape]
    if not rows:
        raise BenchFormatError(f"no {pattern!r} results for shape {shape!r}; shapes present: {shapes}")
    largest = max(rows, key=lambda r: r["bytes"])
    if method == "best":
        method = min(TRANSFER_METHODS, key=lambda m: _seconds(largest, m) or float("inf"))
    if not all(_seconds(r, method) > 0 for r in rows):
        raise BenchFormatError(f"method {method!r} has no positive time in every result")
    tokens = largest["blocks"] * largest.get("block_size", block_size)
    kv_bytes = largest["bytes"] / tokens * largest["layers_in_model"] / largest["layers"]
    sizes = np.array([float(r["bytes"]) for r in rows])
    seconds = np.array([_seconds(r, method) for r in rows])
    bandwidth = float(largest["bytes"]) / _seconds(largest, method)
    overhead = 0.0 if transfer_overhead_s is None else float(transfer_overhead_s)
    if len(set(sizes.tolist())) >= 2:
        slope, intercept = np.polyfit(sizes, seconds, 1)
        if slope > 0:
            bandwidth = 1.0 / float(slope)
            if transfer_overhead_s is None:
                overhead = max(float(intercept), 0.0)
    return CostInputs(kv_bytes_per_token=float(kv_bytes), bandwidth_bytes_per_s=bandwidth,
                      transfer_overhead_s=overhead)
