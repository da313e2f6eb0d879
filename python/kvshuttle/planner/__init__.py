"""The what-if planner: does reading a conversation's KV back from decode pay for a workload, and at what memory?

``kvshuttle plan`` (:mod:`.cli`) replays a trace (:mod:`.trace`) under a cost profile (:mod:`.profile`) in four
modes (no prefix cache, local prefix cache, reverse reads, both) per TTL and threshold (:mod:`.simulate`, which
decides every read with :func:`kvshuttle.policy.decide`), and reports TTFT, whole-turn latency, reuse, bytes
and decode memory held (:mod:`.report`). :mod:`.validate` checks it against this machine's end-to-end runs,
:mod:`.validate_placement` against its placement runs (two prefills behind the router) and :mod:`.published`
against the published H200 + EFA numbers. Stdlib + numpy; tqdm and matplotlib (the ``plan`` extra) only for
progress bars and plots.
"""

from __future__ import annotations

from .errors import PlannerError, ProfileError, TraceError
from .profile import QWEN3_32B, CostProfile, ModelShape, fit_prefill
from .profiles import PROFILE_NAMES, load_profile
from .simulate import MODES, Placement, PreparedTrace, policy_config, retained_stats, simulate, summarize
from .trace import (
    Conversation,
    SyntheticSpec,
    Trace,
    TurnSpec,
    example_trace_path,
    load_trace,
    parse_trace,
    synthetic_trace,
    uniform_trace,
    write_trace,
)

__all__ = [
    "MODES",
    "PROFILE_NAMES",
    "QWEN3_32B",
    "Conversation",
    "CostProfile",
    "ModelShape",
    "Placement",
    "PlannerError",
    "PreparedTrace",
    "ProfileError",
    "SyntheticSpec",
    "Trace",
    "TraceError",
    "TurnSpec",
    "example_trace_path",
    "fit_prefill",
    "load_profile",
    "load_trace",
    "parse_trace",
    "policy_config",
    "retained_stats",
    "simulate",
    "summarize",
    "synthetic_trace",
    "uniform_trace",
    "write_trace",
]
