"""``kvshuttle bench retention``: the decode-side retention ledger's operations at 10k, 100k and 1M live handles.

For each size a ledger (multi-read, a fake clock, TTL far away) is filled with ``n`` handles, then each operation
is timed over ``--ops`` calls on random live handles, median of ``--repeat`` rounds:

* retain: a new handle (released again untimed, so the size stays ``n``);
* claim_complete: claim + complete of one read;
* renew: a heartbeat;
* sweep_idle: a sweep with nothing due (should be O(1));
* sweep_due: one sweep that expires ``--due`` handles retained with a short TTL (O(k log n)), also per handle;
* retain_evict: a retain at a full budget, evicting the least recently touched handle.

The growth check (``summary.growth``) is the time ratio largest/smallest size per operation, next to what
O(log n) predicts (``log n_max / log n_min``, 1.5 for 1M/10k) and what O(n) would (100). Objects built before
timing are moved out of the cyclic GC's way with ``gc.freeze()`` (``--gc normal`` to keep it): a full collection
walks every live object, which is the interpreter's cost, not the ledger's.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..retention import RetentionLedger, RetentionTerms
from .schema import envelope

DIGEST = b"0123456789abcdef"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="10000,100000,1000000",
                        help="live handle counts, comma-separated (default 10k,100k,1M)")
    parser.add_argument("--ops", type=int, default=20000, help="calls per timed round")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds; the median is reported")
    parser.add_argument("--due", type=int, default=1000, help="handles due in the sweep_due case")
    parser.add_argument("--blocks-per-handle", type=int, default=1)
    parser.add_argument("--gc", choices=("freeze", "normal"), default="freeze")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (1k and 10k handles, few calls): checks the bench, measures little")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _per_op_us(fn: Callable[[], object], ops: int, repeat: int) -> float:
    """Median over ``repeat`` rounds of (round time / ops), in microseconds; ``fn`` runs one round."""
    fn()  # warm-up round
    rounds: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        rounds.append(time.perf_counter() - start)
    return statistics.median(rounds) / ops * 1e6


def _measure_size(n: int, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    per = args.blocks_per_handle
    clock = _Clock()
    # nothing expires during the run; multi-read, so a claim does not end its handle
    ledger = RetentionLedger("bench", "127.0.0.1", 5600, terms=RetentionTerms(ttl_s=1e9, read_mode="multi_read"),
                             clock=clock, wall_clock=clock)
    digests = [DIGEST] * per
    tokens = per * 16
    start = time.perf_counter()
    handles = [ledger.retain("r", range(i * per, (i + 1) * per), digests, tokens, 16).handle_id for i in range(n)]
    build_s = time.perf_counter() - start
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()
    next_block = [n * per]
    ops: int = args.ops

    def fresh_ids() -> range:
        first = next_block[0]
        next_block[0] += per
        return range(first, first + per)

    issued: list[str] = []  # released outside the timed region

    def retain_round() -> None:
        issued[:] = [ledger.retain("r", fresh_ids(), digests, tokens, 16).handle_id for _ in range(ops)]

    def timed_retain() -> float:
        rounds: list[float] = []
        for _ in range(args.repeat + 1):
            start = time.perf_counter()
            retain_round()
            rounds.append(time.perf_counter() - start)
            for handle_id in issued:
                ledger.release(handle_id)
        return statistics.median(rounds[1:]) / ops * 1e6

    picks = [handles[i] for i in rng.integers(0, n, size=ops)]
    generation = 0  # every handle is issued before any block goes back: epoch 0

    def claim_round() -> None:
        for handle_id in picks:
            ledger.complete(ledger.claim(handle_id, generation).claim_id)

    def renew_round() -> None:
        for handle_id in picks:
            ledger.renew(handle_id)

    def idle_round() -> None:
        for _ in range(ops):
            ledger.sweep()

    def timed_sweep_due() -> float:
        rounds: list[float] = []
        for _ in range(args.repeat + 1):
            for _ in range(args.due):
                ledger.retain("r", fresh_ids(), digests, tokens, 16, ttl_s=1.0)
            start = time.perf_counter()
            expired = ledger.sweep(now=clock.now + 1.0)
            rounds.append(time.perf_counter() - start)
            if expired != args.due:
                raise AssertionError(f"sweep expired {expired} handles, {args.due} were due")
        return statistics.median(rounds[1:]) * 1e6

    times: dict[str, float] = {}
    times["retain"] = timed_retain()
    times["claim_complete"] = _per_op_us(claim_round, ops, args.repeat)
    times["renew"] = _per_op_us(renew_round, ops, args.repeat)
    times["sweep_idle"] = _per_op_us(idle_round, ops, args.repeat)
    times["sweep_due"] = timed_sweep_due()
    times["sweep_due_per_handle"] = times["sweep_due"] / args.due
    ledger.budget_blocks = len(ledger.retained_block_ids())  # full: every retain now evicts the LRU handle
    times["retain_evict"] = _per_op_us(retain_round, ops, args.repeat)
    if len(ledger) != n or ledger.metrics()["evictions"] < ops:
        raise AssertionError(f"{len(ledger)} live handles after the eviction rounds, expected {n}")
    if args.gc == "freeze":
        gc.unfreeze()
    return {"live_handles": n, "build_s": round(build_s, 3), "rounds": args.repeat, "ops": ops,
            "seconds": {k: float(f"{v / 1e6:.6g}") for k, v in times.items()}, "verified": True}


OPS = ("retain", "claim_complete", "renew", "sweep_idle", "sweep_due_per_handle", "retain_evict")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every ledger operation at each size; returns the :mod:`~kvshuttle.bench.schema` envelope."""
    started = time.perf_counter()
    given = args
    if getattr(args, "quick", False):
        args = argparse.Namespace(**{**vars(args), "sizes": "1000,10000", "ops": 500, "repeat": 2, "due": 100})
    sizes = sorted(int(s) for s in str(args.sizes).split(",") if s)
    if not sizes or sizes[0] < max(2, args.due):
        raise ValueError(f"sizes must be at least --due ({args.due}) handles")
    rng = np.random.default_rng(args.seed)
    results = []
    for n in sizes:
        results.append(_measure_size(n, args, rng))
        gc.collect()  # the ledger of this size is garbage now
    small, large = results[0]["seconds"], results[-1]["seconds"]
    summary = {
        "growth": {op: round(large[op] / small[op], 3) if small[op] > 0 else None for op in OPS},
        "log_n_growth": round(math.log(sizes[-1]) / math.log(sizes[0]), 3),  # what O(log n) growth would give
        "linear_growth": round(sizes[-1] / sizes[0], 1),  # what O(n) growth would give
    }
    note = (f"seconds per operation: median of {args.repeat} rounds of {args.ops} calls (sweep_due: one sweep "
            f"expiring {args.due} handles); growth = time at {sizes[-1]:,} / time at {sizes[0]:,} live handles "
            "(sizes run one after another, not interleaved)")
    if getattr(args, "quick", False):
        note += "; --quick: a smoke run"
    return envelope("retention", args, add_arguments, results, note=note, started=started, summary=summary,
                    command_args=given)


def format_table(result: dict[str, Any]) -> str:
    names = ("retain", "claim+complete", "renew", "sweep idle", "sweep due/handle", "retain+evict")
    lines = [f"{'live handles':>13}" + "".join(f"{name:>18}" for name in names) + f"{'build s':>10}"]
    for r in result["results"]:
        lines.append(f"{r['live_handles']:>13,}" + "".join(f"{r['seconds'][op] * 1e6:>18.2f}" for op in OPS)
                     + f"{r['build_s']:>10.1f}")
    summary = result["summary"]
    lines.append(f"{'growth':>13}" + "".join(f"{summary['growth'][op]:>18.2f}" for op in OPS))
    lines.append(f"microseconds per operation; growth: O(log n) would give {summary['log_n_growth']}, "
                 f"O(n) {summary['linear_growth']}; {result['note']}")
    return "\n".join(lines)
