"""The ``kvshuttle`` command: ``demo``, ``info``, ``plan``, ``bench pack|plan|transfer|policy|retention|e2e``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

BENCHES = {
    "pack": "kvshuttle.bench.pack",
    "plan": "kvshuttle.bench.plan",
    "transfer": "kvshuttle.bench.transfer",
    "policy": "kvshuttle.bench.policy",
    "retention": "kvshuttle.bench.retention",
    "index": "kvshuttle.bench.index",
    "e2e": "kvshuttle.bench.e2e.bench",
    "router": "kvshuttle.bench.router",
    "placement": "kvshuttle.bench.e2e.placement",
    "demotion": "kvshuttle.bench.e2e.demotion",
    "clients": "kvshuttle.bench.clients",
    "tier-replay": "kvshuttle.bench.tier_replay",
    "retokenize": "kvshuttle.bench.retokenize",
    "report": "kvshuttle.bench.report",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshuttle", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="what was built, whether a GPU is usable, which deployment secret is in use")
    demo = commands.add_parser("demo", help="decode + prefill processes: a multi-turn conversation read back over NIXL")
    from .demo import run as demo_module

    demo_module.add_arguments(demo)
    try:  # the router extra (aiohttp, redis, prometheus-client) may not be installed
        from .router import main as router_module
    except ImportError:
        router_module = None  # type: ignore[assignment]
    if router_module is not None:
        router = commands.add_parser("router", help="multi-turn router: carries decode handles between turns")
        router_module.add_arguments(router)
    plan = commands.add_parser("plan", help="what-if planner: does reading KV back from decode pay for a workload")
    from .planner import cli as plan_module

    plan_module.add_arguments(plan)
    bench = commands.add_parser("bench", help="microbenchmarks with ratios against a peer measured in the same run")
    which = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        sub = which.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(sub)
        sub.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        sub.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run as demo_module

        return demo_module.main(args)
    if args.command == "plan":
        from .planner import cli as plan_module

        return plan_module.main(args)
    if args.command == "router":
        from .router import main as router_module

        return router_module.main(args)
    if args.command == "info":
        from . import build_info
        from .trust import DeploymentSecret, TrustError

        info: dict[str, object] = dict(build_info())
        try:  # never the secret itself: its scope, where it came from, and a fingerprint to compare across hosts
            secret = DeploymentSecret.resolve()
            info["trust"] = {"scope": secret.scope, "source": secret.source, "fingerprint": secret.fingerprint}
        except TrustError as exc:
            info["trust"] = {"error": str(exc)}
        print(json.dumps(info, indent=2))
        return 0
    result = args.module.run(args)
    if args.json:
        print(json.dumps(result))
    else:
        formatter = getattr(args.module, "format_table", None)
        print(formatter(result) if formatter else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
