"""``kvshuttle plan``: does reading old context back from decode pay for this workload, and what does it hold?

    kvshuttle plan                                   # the bundled agent trace, the H200 + EFA profile
    kvshuttle plan --trace my.jsonl --profile measured --ttl 60,240,480 --threshold 64,256,cost --plots out/
    kvshuttle plan --trace conversation_trace.jsonl --trace-format mooncake   # a raw public trace, converted
    kvshuttle plan --synthetic conversations=50,human_fraction=0.5,human_gap_s=600 --json
    kvshuttle plan --tp-size 4 --json                # the profile's KV split over 4 TP ranks
    kvshuttle plan --cases                           # no reusable context, pauses past the TTL, edited history
    kvshuttle plan --validate                        # predictions vs the shipped vm2_e2e.json run, per row
    kvshuttle plan --validate-placement              # ... vs the shipped vm2_placement.json, per config
    kvshuttle plan --reproduce                       # the published Qwen3-32B H200 curve, on and off
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from ..retention.terms import DEFAULT_TTL_S
from .errors import PlannerError
from .profiles import PROFILE_NAMES, load_profile
from .simulate import Threshold
from .tiers import Tier
from .trace import SyntheticSpec, example_trace_path, synthetic_trace, write_trace
from .trace_formats import TRACE_FORMATS, load_trace_as


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", help="JSON-lines trace (default: the bundled agent trace)")
    parser.add_argument("--trace-format", choices=TRACE_FORMATS, default="kvshuttle",
                        help="how --trace is written: kvshuttle (the planner's JSON lines, default), claude-code "
                             "(kv-cache-tester Claude Code sessions: a session's .json file or a folder of them), "
                             "mooncake (a Mooncake FAST'25 trace: conversations rebuilt from the shared block hashes)")
    source.add_argument("--synthetic", metavar="K=V,...", nargs="?", const="",
                        help="a generated trace: conversations, turns_min, turns_max, first_tokens, new_tokens, "
                             "output_tokens, tool_gap_s, human_gap_s, human_fraction, edit_fraction, "
                             "fresh_fraction, start_window_s, seed")
    parser.add_argument("--profile", default="h200-efa-qwen3-32b",
                        help=f"{' | '.join(PROFILE_NAMES)} | a JSON file (default: h200-efa-qwen3-32b)")
    parser.add_argument("--ttl", default=f"60,240,{DEFAULT_TTL_S:g}",
                        help="decoder_kv_blocks_ttl values (s), comma-separated")
    parser.add_argument("--threshold", default="64,256,1024",
                        help="kv_recompute_threshold values (tokens; 'cost': the policy's cost model)")
    parser.add_argument("--prefill-workers", type=int, default=1,
                        help="prefill workers turns are routed to (at random, or by --affinity)")
    parser.add_argument("--affinity", action="store_true",
                        help="the router keeps each conversation on one prefill worker (kvshuttle router's default)")
    parser.add_argument("--round-robin", action="store_true",
                        help="without --affinity: turns go to the workers in turn by arrival (kvshuttle router "
                             "--affinity none), not at random")
    parser.add_argument("--prewarm", action="store_true",
                        help="with --affinity: the router pre-warms the next turn's worker with prompt and answer")
    parser.add_argument("--decode-local", type=int, default=0, metavar="N",
                        help="turns computing at most N tokens run on the decode that holds the conversation")
    parser.add_argument("--prefill-cache-gib", type=float, default=None, help="override the profile's prefix cache")
    parser.add_argument("--tp-size", type=int, default=None, metavar="N",
                        help="override the profile's TP size: the KV splits over N ranks by KV heads, each reading "
                             "its shard over its own link (the profile's bandwidth is per rank); prefill and decode "
                             "times stay the profile's")
    parser.add_argument("--tier", action="append", default=[], metavar="NAME:TTL_S:GBPS[:OVERHEAD_MS[:PRICE]]",
                        help="a lower retention tier after the hot one (repeat, in order), e.g. host:1800:25:0.2:0.001 "
                             "(TTL counted from when a retention moved there; GB/s per rank; $ per GiB-hour): "
                             "a turn after the hot TTL reads from the tier its retention is in")
    parser.add_argument("--queue", action="store_true", help="requests wait for their prefill worker (FIFO)")
    parser.add_argument("--expiry-margin", type=float, default=5.0, help="seconds of TTL a read needs left")
    parser.add_argument("--plots", metavar="DIR", help="write ttft_vs_prompt.png and retained_vs_ttl.png here")
    parser.add_argument("--write-trace", metavar="FILE", help="also write the trace used as JSON lines")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--validate", metavar="E2E_JSON", nargs="?", const="",
                      help="predictions vs a 'kvshuttle bench e2e --json' output (default: the "
                           "vm2_e2e.json run shipped with the planner), per row")
    what.add_argument("--validate-placement", metavar="PLACEMENT_JSON", nargs="?", const="",
                      help="predictions vs a 'kvshuttle bench placement --json' output (default: the "
                           "vm2_placement.json run shipped with the planner), per configuration")
    what.add_argument("--reproduce", action="store_true",
                      help="planner TTFT on/off vs prompt length next to the published H200 points")
    what.add_argument("--cases", action="store_true", help="no reusable context, pauses past the TTL, edited history")


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise PlannerError(f"--{what} takes comma-separated numbers, got {text!r}") from None
    if not values or any(not v >= 0 for v in values):
        raise PlannerError(f"--{what} needs numbers >= 0, got {text!r}")
    return values


def _thresholds(text: str) -> list[Threshold]:
    out: list[Threshold] = []
    for item in (s.strip() for s in text.split(",")):
        if item == "cost":
            out.append("cost")
        elif item.lstrip("-").isdigit():
            out.append(int(item))
        elif item:
            raise PlannerError(f"--threshold takes integers or 'cost', got {item!r}")
    if not out:
        raise PlannerError("--threshold needs at least one value")
    return out


def _emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    print(json.dumps(doc, default=str) if args.json else text)


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except PlannerError as exc:
        print(f"kvshuttle plan: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.validate is not None:
        from .validate import default_e2e_path, default_transfer_paths, format_validation, load_e2e, validate

        path = Path(args.validate) if args.validate else default_e2e_path()
        result = validate(load_e2e(path), [str(p) for p in default_transfer_paths(path)])
        result["source"] = str(path)
        _emit(args, result, f"{path}\n" + format_validation(result))
        return 0
    if args.validate_placement is not None:
        from .validate_placement import default_placement_path, format_placement_validation, validate_placement_file

        path = Path(args.validate_placement) if args.validate_placement else default_placement_path()
        result = validate_placement_file(path)
        _emit(args, result, f"{path}\n" + format_placement_validation(result))
        return 0
    profile = load_profile(args.profile)
    if args.prefill_cache_gib is not None:
        profile = profile.with_changes(prefill_cache_gib=args.prefill_cache_gib)
    if args.tp_size is not None:
        profile = profile.with_changes(tp_size=args.tp_size)
    if args.reproduce:
        from .published import format_reproduction, reproduce

        rows = reproduce(profile)
        _emit(args, {"profile": profile.to_dict(), "rows": rows}, format_reproduction(rows, profile))
        return 0
    ttls, thresholds = _floats(args.ttl, "ttl"), _thresholds(args.threshold)
    if args.cases:
        from .report import format_cases, run_cases

        rows = run_cases(profile, ttls[0], thresholds[0])
        _emit(args, {"profile": profile.to_dict(), "ttl_s": ttls[0], "threshold": thresholds[0], "cases": rows},
              format_cases(rows, ttls[0], thresholds[0]))
        return 0
    if args.trace_format != "kvshuttle" and not args.trace:
        raise PlannerError(f"--trace-format {args.trace_format} reads the file --trace names: give --trace")
    if args.synthetic is not None:
        trace = synthetic_trace(SyntheticSpec.parse(args.synthetic))
    else:
        trace = load_trace_as(args.trace or example_trace_path(), args.trace_format)
    if args.write_trace:
        Path(args.write_trace).write_text(write_trace(trace), encoding="utf-8")
    from .report import format_plan, run_plan, write_plots
    from .simulate import Placement

    if args.prewarm and not args.affinity:
        raise PlannerError("--prewarm needs --affinity (the router warms the worker the next turn goes to)")
    if args.round_robin and args.affinity:
        raise PlannerError("--round-robin is the routing without --affinity: give one of them")

    command = "kvshuttle plan " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    doc, runs = run_plan(trace, profile, ttls, thresholds, prefill_workers=args.prefill_workers, queue=args.queue,
                         expiry_margin_s=args.expiry_margin, progress=not args.no_progress and not args.json,
                         command=command.strip() or "kvshuttle plan",
                         placement=Placement(args.affinity, args.prewarm, args.decode_local,
                                             round_robin=args.round_robin),
                         tiers=[Tier.parse(t) for t in args.tier])
    if args.plots:
        doc["plots"] = [str(p) for p in write_plots(doc, runs, args.plots)]
    text = format_plan(doc)
    if args.plots:
        text += "\nplots: " + ", ".join(doc["plots"])
    _emit(args, doc, text)
    return 0
