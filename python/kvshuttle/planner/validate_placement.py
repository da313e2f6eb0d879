"""The planner against ``kvshuttle bench placement --json`` (``benchmarks/results/vm2_placement.json``).

The bench runs two prefill ``vllm serve`` engines (prefix caches on) and one decode behind ``kvshuttle router``,
one request in flight at a time, the conversations in turn each round (:mod:`kvshuttle.bench.e2e.placement`).
Each configuration is replayed here with :func:`~.simulate.simulate` on its own measured conversations:

* **the trace**: per conversation the measured prompt length of every turn; a later turn's history is the
  previous prompt and its ``answer_tokens`` answer, the rest of its prompt new. The chat template re-renders an
  answer as text and re-tokenizes it, and with the tiny random model none of those ids equals what the decode
  generated (the data shows it: ``spread_reverse`` reads exactly the previous prompt's whole blocks, and the
  affinity configurations read nothing, their local hit covering as much), so the trace is prepared with
  ``answer_kept_tokens=0`` (:class:`~.simulate.PreparedTrace`). A pre-warmed prefill (``prewarm``, and the
  ``floor``, which the bench warms itself) computed the re-rendered history, so its hit covers prompt and answer.
* **the routing**: affinity configurations keep each conversation on the prefill the router gave it (its
  measured home); ``spread_*`` (``--affinity none``) go round robin over the prefills in arrival order; the
  client is ``one_at_a_time`` (:func:`~.simulate.simulate`), with the bench's gap. ``decode_local`` sends a turn
  of at most ``decode_local`` new tokens to the decode, computed there with the same cost model.
* **the cost profile**: prefill fixed cost, throughput and attention ratio (:func:`~.profile.fit_prefill` on
  tokens computed and the tokens cached before them) fitted on the ``fit`` rows: every configuration's turn-1
  rows (nothing cached anywhere: the same work in every configuration) and the floor's later turns (the
  smallest computes, after the longest cached histories: they pin the fixed cost and the attention term). So the
  ``floor`` row is ``fit``; every other configuration's later turns are predictions. The read cost comes from
  ``kvshuttle bench transfer`` on the same machine (``vm2_transfer*.json``, contiguous ids, best path, as
  :mod:`.validate`); the decode's time per answer token is the median over the fit rows of (turn - TTFT) / answer.

Per configuration: the median TTFT of its later turns (client side, through the router: the router's hop and
the decode's first token are in the fitted fixed cost), over the floor's, the median turn latency, and the later
turns' summed tokens from the prefill's own cache, read from the decode and computed. A prediction is within the
target when its median TTFT is within 20 % of the measurement; every miss gets the reasons this module can tell
from the data (how far the measured turns spread, tokens that differ and why).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlannerError
from .profile import CostProfile, fit_prefill
from .simulate import Mode, ModeRun, Placement, PreparedTrace, simulate
from .trace import Conversation, Trace, TurnSpec
from .transfer_costs import cost_inputs_from_bench
from .validate import TARGET, TINY_KV_BYTES_PER_TOKEN, TINY_LAYERS, default_transfer_paths, measured_path

_TURN_FIELDS = ("conversation", "turn", "ttft_s", "latency_s", "placement", "prefill", "prompt_tokens",
                "local_tokens", "read_tokens", "computed_tokens")
TOKEN_KINDS = ("local", "read", "computed")
BLOCK = 32  # the placement bench's block size (kvshuttle.bench.e2e.placement.BLOCK; a test holds them equal)


@dataclass(frozen=True)
class ConfigModel:
    """How one bench configuration is simulated: the mode, and the router's placement (homes filled in later)."""

    mode: Mode
    affinity: bool
    prewarm: bool = False
    decode_local: bool = False


CONFIG_MODELS: dict[str, ConfigModel] = {
    "floor": ConfigModel("reverse_read+local_cache", affinity=True, prewarm=True),  # the bench warms it itself
    "local_cache": ConfigModel("local_cache", affinity=True),
    "reverse_reads": ConfigModel("reverse_read+local_cache", affinity=True),
    "spread_local": ConfigModel("local_cache", affinity=False),
    "spread_reverse": ConfigModel("reverse_read+local_cache", affinity=False),
    "prewarm": ConfigModel("reverse_read+local_cache", affinity=True, prewarm=True),
    "decode_local": ConfigModel("reverse_read+local_cache", affinity=True, decode_local=True),
}
FLOOR = "floor"


def default_placement_path() -> Path:
    """The shipped copy of ``benchmarks/results/vm2_placement.json`` (:func:`~.validate.measured_path`)."""
    return measured_path("vm2_placement.json")


def load_placement(path: str | Path) -> dict[str, Any]:
    """A ``kvshuttle bench placement --json`` output, its rows checked (PlannerError names what is wrong)."""
    try:
        data = json.loads(Path(path).read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError(f"{path}: not a readable 'kvshuttle bench placement --json' output: {exc}") from None
    check_placement(data, str(path))
    return data  # type: ignore[no-any-return]


def check_placement(data: Any, source: str = "<placement>") -> None:
    if not isinstance(data, dict) or data.get("bench") != "placement" or not isinstance(data.get("results"), list):
        raise PlannerError(f"{source}: expected the output of 'kvshuttle bench placement --json'")
    config = data.get("config")
    for key in ("answer_tokens", "gap_s", "decode_local"):
        if not isinstance(config, dict) or not isinstance(config.get(key), (int, float)):
            raise PlannerError(f"{source}: config.{key} missing or not a number")
    for r in data["results"]:
        if not isinstance(r, dict) or not isinstance(r.get("config"), str) or not isinstance(r.get("turns"), list):
            raise PlannerError(f"{source}: every result needs a 'config' name and a 'turns' list")
        for t in r["turns"]:
            missing = [f for f in _TURN_FIELDS if not isinstance(t, dict) or f not in t]
            if missing:
                raise PlannerError(f"{source}: a turn of {r['config']!r} lacks {', '.join(missing)}")
    if not any(r["config"] == FLOOR for r in data["results"]):
        raise PlannerError(f"{source}: no 'floor' configuration (its later turns are fitted, and TTFT is shown "
                           "over the floor's)")


def _by_conversation(turns: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    out: dict[int, list[Mapping[str, Any]]] = {}
    for t in sorted(turns, key=lambda t: (int(t["conversation"]), int(t["turn"]))):
        out.setdefault(int(t["conversation"]), []).append(t)
    for conv, rows in out.items():
        if [int(t["turn"]) for t in rows] != list(range(1, len(rows) + 1)):
            raise PlannerError(f"conversation {conv}: turns must be 1, 2, ... without gaps")
    return out


def measured_trace(turns: Sequence[Mapping[str, Any]], *, answer_tokens: int, gap_s: float,
                   name: str = "placement") -> Trace:
    """The conversations a configuration ran: measured prompts, each later turn's history the previous prompt
    and its answer (re-rendered: see the module docstring), the bench's gap."""
    conversations = []
    for conv, rows in _by_conversation(turns).items():
        specs, previous = [], 0
        for t in rows:
            prompt = int(t["prompt_tokens"])
            history = previous + answer_tokens if previous else 0
            if prompt < history:
                raise PlannerError(f"{name} conversation {conv} turn {t['turn']}: prompt of {prompt} tokens is "
                                   f"shorter than the previous prompt and its answer ({history})")
            specs.append(TurnSpec(prompt, prompt - history, answer_tokens, gap_s if previous else 0.0))
            previous = prompt
        conversations.append(Conversation(f"{name}-{conv}", tuple(specs)))
    return Trace(tuple(conversations), source=name)


def measured_homes(turns: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """Per conversation (in order) the prefill that served most of its turns (the router's home for it)."""
    homes = []
    for conv, rows in _by_conversation(turns).items():
        served = Counter(int(t["prefill"]) for t in rows if t["prefill"] is not None)
        if not served:
            raise PlannerError(f"conversation {conv}: no turn names the prefill that served it")
        homes.append(served.most_common(1)[0][0])
    return tuple(homes)


def _cached(t: Mapping[str, Any]) -> int:
    return int(t["local_tokens"]) + int(t["read_tokens"])


def fit_rows(placement: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(config, turn)`` of every row the prefill model is fitted on: turn-1 rows and the floor's later turns."""
    return [(r["config"], t) for r in placement["results"] if r["config"] in CONFIG_MODELS for t in r["turns"]
            if int(t["turn"]) == 1 or r["config"] == FLOOR]


def fit_placement_profile(placement: Mapping[str, Any], transfer: Sequence[Any]) -> CostProfile:
    """The cost profile of the placement run (see the module docstring)."""
    rows = [t for _, t in fit_rows(placement)]
    samples = [(float(t["computed_tokens"]), t["computed_tokens"] * (_cached(t) + t["computed_tokens"] / 2.0),
                float(t["ttft_s"])) for t in rows]
    fixed, throughput, ratio = fit_prefill(samples)
    inputs = cost_inputs_from_bench(list(transfer), shape="qwen3-32b-tp1", pattern="contiguous")
    answer = int(placement["config"]["answer_tokens"])
    decode = statistics.median((float(t["latency_s"]) - float(t["ttft_s"])) / answer for t in rows)
    return CostProfile(
        name="measured-placement", kv_bytes_per_token=float(TINY_KV_BYTES_PER_TOKEN), block_size=BLOCK,
        bandwidth_bytes_per_s=inputs["bandwidth_bytes_per_s"], transfer_overhead_s=inputs["transfer_overhead_s"],
        prefill_fixed_s=fixed, prefill_tokens_per_s=throughput, attention_ratio=ratio, decode_fixed_s=0.0,
        decode_s_per_token=decode, prefill_cache_gib=1.0, num_layers=TINY_LAYERS,
        notes="kvshuttle bench placement's run: prefill fitted to every turn-1 row and the floor's later turns "
              "(client TTFT through the router); transfer from kvshuttle bench transfer (contiguous, best path)")


def simulate_config(result: Mapping[str, Any], profile: CostProfile, run_config: Mapping[str, Any],
                    prefill_workers: int) -> ModeRun:
    """One configuration replayed on its own measured conversations."""
    model = CONFIG_MODELS[result["config"]]
    trace = measured_trace(result["turns"], answer_tokens=int(run_config["answer_tokens"]),
                           gap_s=float(run_config["gap_s"]), name=result["config"])
    placement = Placement(affinity=model.affinity, prewarm=model.prewarm, round_robin=not model.affinity,
                          decode_local_tokens=int(run_config["decode_local"]) if model.decode_local else 0,
                          homes=measured_homes(result["turns"]) if model.affinity else ())
    prepared = PreparedTrace(trace, profile.block_size, answer_kept_tokens=0)
    return simulate(prepared, profile, mode=model.mode, prefill_workers=prefill_workers, placement=placement,
                    one_at_a_time=True)


def _measured(result: Mapping[str, Any]) -> dict[str, Any]:
    later = [t for t in result["turns"] if int(t["turn"]) > 1]
    if not later:
        raise PlannerError(f"{result['config']}: no later turns to compare")
    return {"ttft_s": statistics.median(float(t["ttft_s"]) for t in later),
            "turn_s": statistics.median(float(t["latency_s"]) for t in later),
            "ttft_range_s": (min(float(t["ttft_s"]) for t in later), max(float(t["ttft_s"]) for t in later)),
            "local": sum(int(t["local_tokens"]) for t in later), "read": sum(int(t["read_tokens"]) for t in later),
            "computed": sum(int(t["computed_tokens"]) for t in later),
            "decode_local_turns": sum(t["placement"] == "decode_local" for t in later)}


def _predicted(run: ModeRun) -> dict[str, Any]:
    later = [i for i, is_later in enumerate(run.later) if is_later]
    return {"ttft_s": statistics.median(run.ttft[i] for i in later),
            "turn_s": statistics.median(run.ttft[i] + run.decode[i] for i in later),
            "local": sum(run.local[i] for i in later), "read": sum(run.fetched[i] for i in later),
            "computed": sum(run.recomputed[i] for i in later),
            "decode_local_turns": run.reasons.get("decode_local", 0)}


def per_turn_errors(turns: Sequence[Mapping[str, Any]], run: ModeRun) -> dict[tuple[int, int], float]:
    """Predicted / measured TTFT - 1 of every later turn, by ``(conversation, turn)`` (turns from 1)."""
    measured = {(int(t["conversation"]), int(t["turn"])): float(t["ttft_s"]) for t in turns}
    return {(conv, k + 1): run.ttft[i] / measured[(conv, k + 1)] - 1 for i, (conv, k) in enumerate(run.turn_keys)
            if k}


def miss_reasons(name: str, measured: Mapping[str, Any], predicted: Mapping[str, Any],
                 errors: Mapping[tuple[int, int], float], turns: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the data says about a miss: how far the measured turns spread, on which prefill the errors lie,
    which tokens differ and why."""
    low, high = measured["ttft_range_s"]
    inside = "inside" if low <= predicted["ttft_s"] <= high else "outside"
    within = sum(abs(e) <= TARGET for e in errors.values())
    reasons = [f"its later turns' TTFT ranged {low:.2f}-{high:.2f} s; the prediction is {inside} that range; "
               f"per turn {within} of {len(errors)} within +-{TARGET:.0%} (median error "
               f"{statistics.median(errors.values()) * 100:+.0f}%)"]
    by_prefill: dict[int, list[float]] = {}
    for t in turns:  # the same work on each prefill: does one of them run slower than the other?
        key = (int(t["conversation"]), int(t["turn"]))
        if key in errors and t["prefill"] is not None:
            by_prefill.setdefault(int(t["prefill"]), []).append(errors[key])
    if len(by_prefill) > 1:
        reasons.append("median error by the prefill that computed the turn: " + ", ".join(
            f"prefill {i} {statistics.median(e) * 100:+.0f}% ({len(e)} turns)" for i, e in sorted(by_prefill.items())))
    differ = [k for k in TOKEN_KINDS if measured[k] != predicted[k]]
    if differ:
        reasons.append("tokens differ (" + ", ".join(f"{k} {predicted[k]} predicted, {measured[k]} measured"
                                                    for k in differ) + ")")
    if measured["decode_local_turns"] != predicted["decode_local_turns"]:
        reasons.append(f"decode-local turns: {predicted['decode_local_turns']} predicted, "
                       f"{measured['decode_local_turns']} measured: the router decides on its text estimate of the "
                       "new tokens (UTF-8 bytes / 4 + 8 per message), the planner on their token count")
    if CONFIG_MODELS[name].decode_local and predicted["ttft_s"] > measured["ttft_s"]:
        reasons.append("computed on the decode: the fixed cost was fitted on turns through a prefill, which also "
                       "pay the KV hand-off to the decode that a decode-local turn skips")
    if predicted["read"] and predicted["ttft_s"] < measured["ttft_s"]:
        reasons.append("the read cost is kvshuttle bench transfer's, measured alone; here the reads ran on the "
                       "loaded machine, into a prefill sharing its core with the other")
    return reasons


def validate_placement(placement: Mapping[str, Any], transfer: Sequence[Any]) -> dict[str, Any]:
    """Predicted vs measured later turns of every configuration (see the module docstring)."""
    check_placement(placement)
    profile = fit_placement_profile(placement, transfer)
    run_config = placement["config"]
    workers = max([int(t["prefill"]) + 1 for r in placement["results"] for t in r["turns"]
                   if t["prefill"] is not None] + [1])
    results = {r["config"]: r for r in placement["results"]}
    runs = {name: simulate_config(r, profile, run_config, workers) for name, r in results.items()
            if name in CONFIG_MODELS}
    predictions = {name: _predicted(run) for name, run in runs.items()}
    floor_measured, floor_predicted = _measured(results[FLOOR])["ttft_s"], predictions[FLOOR]["ttft_s"]
    rows = []
    for name, pred in predictions.items():
        meas = _measured(results[name])
        error = pred["ttft_s"] / meas["ttft_s"] - 1
        kind = "fit" if name == FLOOR else "predicted"
        errors = per_turn_errors(results[name]["turns"], runs[name])
        row = {"config": name, "kind": kind, "measured": meas, "predicted": pred, "ttft_error": error,
               "measured_over_floor": meas["ttft_s"] / floor_measured,
               "predicted_over_floor": pred["ttft_s"] / floor_predicted,
               "tokens_match": all(meas[k] == pred[k] for k in TOKEN_KINDS),
               "per_turn_within": sum(abs(e) <= TARGET for e in errors.values()), "per_turn": len(errors),
               "per_turn_median_error": statistics.median(errors.values()),
               "miss": kind == "predicted" and abs(error) > TARGET}
        row["reasons"] = miss_reasons(name, meas, pred, errors, results[name]["turns"]) if row["miss"] else []
        rows.append(row)
    predicted = [x for x in rows if x["kind"] == "predicted"]
    fitted = [(float(t["ttft_s"]), profile.prefill_fixed_s + profile.compute_s(int(t["computed_tokens"]), _cached(t)))
              for _, t in fit_rows(placement)]
    residuals = sorted(p / m - 1 for m, p in fitted)
    return {"profile": profile.to_dict(), "rows": rows,
            "not_modelled": sorted(set(results) - set(CONFIG_MODELS)),
            "summary": {"target": f"|median later-turn TTFT error| <= {TARGET:.0%} on predicted configurations",
                        "predicted_configs": len(predicted),
                        "within_target": sum(not x["miss"] for x in predicted),
                        "tokens_match": sum(x["tokens_match"] for x in predicted),
                        "per_turn_within": sum(x["per_turn_within"] for x in predicted),
                        "per_turn": sum(x["per_turn"] for x in predicted),
                        "fit_rows": len(fitted), "fit_residual_range": (residuals[0], residuals[-1]),
                        "fit_residual_median_abs": statistics.median(abs(r) for r in residuals)}}


def format_placement_validation(result: Mapping[str, Any]) -> str:
    lines = [f"{'config':<15}{'TTFT p50':>9}{'pred':>7}{'error':>7}{'/floor':>7}{'pred':>6}{'turn p50':>9}"
             f"{'pred':>7}{'local':>7}{'pred':>7}{'read':>6}{'pred':>6}{'computed':>9}{'pred':>6}{'dec-loc':>8}"
             f"{'pred':>5}{'turns ok':>9}  kind"]
    for x in result["rows"]:
        m, p = x["measured"], x["predicted"]
        lines.append(f"{x['config']:<15}{m['ttft_s']:>9.3f}{p['ttft_s']:>7.3f}{x['ttft_error'] * 100:>+6.0f}%"
                     f"{x['measured_over_floor']:>7.2f}{x['predicted_over_floor']:>6.2f}{m['turn_s']:>9.3f}"
                     f"{p['turn_s']:>7.3f}{m['local']:>7}{p['local']:>7}{m['read']:>6}{p['read']:>6}"
                     f"{m['computed']:>9}{p['computed']:>6}{m['decode_local_turns']:>8}{p['decode_local_turns']:>5}"
                     f"{str(x['per_turn_within']) + '/' + str(x['per_turn']):>9}  {x['kind']}"
                     f"{'  MISS' if x['miss'] else ''}")
    s, prof = result["summary"], result["profile"]
    low, high = s["fit_residual_range"]
    lines += [f"{s['within_target']} of {s['predicted_configs']} predicted configurations within +-{TARGET:.0%} on "
              f"median later-turn TTFT; tokens (local/read/computed summed) match on {s['tokens_match']} of "
              f"{s['predicted_configs']}; per turn {s['per_turn_within']} of {s['per_turn']} within +-{TARGET:.0%}",
              f"fit = every turn-1 row and the floor's later turns ({s['fit_rows']} rows): prefill "
              f"{prof['prefill_fixed_s'] * 1e3:.0f} ms + {prof['prefill_tokens_per_s']:.0f} tokens/s, attention ratio "
              f"{prof['attention_ratio']:.2e}; their TTFT residuals {low * 100:+.0f}% to {high * 100:+.0f}% (median "
              f"|residual| {s['fit_residual_median_abs']:.0%}); read {prof['transfer_overhead_s'] * 1e3:.0f} ms + "
              f"{prof['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; decode {prof['decode_s_per_token'] * 1e3:.0f} "
              "ms/token"]
    for x in result["rows"]:
        if x["miss"]:
            lines.append(f"MISS {x['config']}: " + "; ".join(x["reasons"]))
    if result["not_modelled"]:
        lines.append("not modelled: " + ", ".join(result["not_modelled"]))
    return "\n".join(lines)


def validate_placement_file(path: str | Path) -> dict[str, Any]:
    """:func:`validate_placement` on a file, with the transfer bench results next to it."""
    placement = load_placement(path)
    transfer = [str(p) for p in default_transfer_paths(Path(path))]
    if not transfer:
        raise PlannerError(f"no vm2_transfer.json next to {path}: the read cost comes from 'kvshuttle bench "
                           "transfer --json'")
    result = validate_placement(placement, transfer)
    result["source"] = str(path)
    return result
