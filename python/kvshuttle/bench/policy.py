"""``kvshuttle bench policy``: decide() per request and the digest chain per block, against naive peers.

Two measurements, both at 24k tokens (1,536 blocks of 16) by default:

* ``decide``: one :func:`kvshuttle.policy.decide` with the prompt's digests precomputed (``PromptDigests``) and
  a parsed handle, for a pure continuation (every block verified), an edit in the middle (the first mismatch
  is found) and a local hit over half the prompt. The peer is the per-block Python comparison loop that finds
  the first mismatch (the verification step alone: a lower bound for a decide built on it). Context, not
  compared: ``decide`` from raw token ids (digesting included) and parsing the handle from its wire form.
* ``digests``: :func:`kvshuttle.policy.digests.block_digests` per block from a numpy array and from a Python list.
  Peers: vLLM's default prefix-cache hash (``sha256(pickle.dumps((parent, tuple(block_tokens), extra)))`` per
  block from a Python list) and a naive blake2b (encode each block's list slice, a fresh hasher per block).

Targets: decide <= 50 us per request, <= 1 us per 16-token block; the result says whether they were met here.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import time
from typing import Any

import numpy as np

from ..policy.decision import Decision, PolicyConfig, decide, parse_handle
from ..policy.digests import PERSON, PromptDigests, block_digests
from ..policy.kv_handle import KVHandle
from ..retention.terms import DEFAULT_TTL_S
from ..trust import DeploymentSecret
from .schema import envelope
from .timing import interleaved_rounds, medians, speedups

DECIDE_TARGET_US = 50.0
DIGEST_TARGET_NS = 1000.0
NOW = 1_700_000_000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=1536, help="remote blocks (1,536 = 24k tokens at 16)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens of the new turn after D's")
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds (methods interleaved)")
    parser.add_argument("--number", type=int, default=200, help="decide() calls per method per round")
    parser.add_argument("--seed", type=int, default=0)


BENCH_SECRET = DeploymentSecret(b"kvshuttle-bench-policy-secret-0123456789")


def make_handle(remote: np.ndarray[Any, Any], block_size: int, expiry_in: float = 300.0) -> KVHandle:
    """A decode's handle for ``remote`` tokens, through the wire format (as prefill receives it)."""
    digests = block_digests(remote, block_size)
    handle = KVHandle(engine_id="decode-0", request_id="req-0", host="127.0.0.1", port=5600,
                      block_ids=tuple(range(7, 7 + len(digests))), num_tokens=len(remote),
                      expiry_time=NOW + expiry_in, tp_size=1, handle_id="0" * 32, generation=1,
                      block_size=block_size, digests=tuple(digests), issued_at=NOW, ttl_s=DEFAULT_TTL_S)
    parsed = parse_handle(handle.to_kv_transfer_params(BENCH_SECRET), secret=BENCH_SECRET)
    if not isinstance(parsed, KVHandle):
        raise AssertionError(f"the bench's own handle did not parse: {parsed.message}")
    return parsed


def naive_first_mismatch(remote: tuple[bytes, ...], prompt: list[bytes]) -> int:
    """The peer: compare digests one block at a time in Python."""
    for k in range(min(len(remote), len(prompt))):
        if remote[k] != prompt[k]:
            return k
    return min(len(remote), len(prompt))


def vllm_style_digests(tokens: list[int], block_size: int, extra: Any = None) -> list[bytes]:
    """vLLM's default ``sha256`` prefix-cache hash: pickle (parent, block tokens, extra keys) per block."""
    out: list[bytes] = []
    parent = b"\x00" * 32
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[start:start + block_size]), extra),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def naive_blake2b_digests(tokens: list[int], block_size: int) -> list[bytes]:
    """The same chain as ours, done naively: encode each block's list slice, a fresh hasher per block."""
    out: list[bytes] = []
    parent = bytes(16)
    salt = hashlib.blake2b(b"", digest_size=16, person=b"kvshuttle.key.v1").digest()
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        block = np.asarray(tokens[start:start + block_size], dtype="<u4").tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16, person=PERSON, salt=salt).digest()
        out.append(parent)
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def _sig(seconds: float) -> float:
    return float(f"{seconds:.6g}")


def _decide_cases(args: argparse.Namespace, rng: np.random.Generator) -> list[dict[str, Any]]:
    bs = args.block_size
    remote = rng.integers(0, 150_000, size=args.blocks * bs - 7)  # a partial last block, as D usually has
    handle = make_handle(remote, bs)
    params = handle.to_kv_transfer_params(BENCH_SECRET)  # parsed as the serving path does: MAC checked
    prompt = np.concatenate([remote, rng.integers(0, 150_000, size=args.new_tokens)])
    edited = prompt.copy()
    edited[(args.blocks // 2) * bs + 3] ^= 1
    config = PolicyConfig()
    remote_full = handle.digests[:handle.num_tokens // bs]  # the partial last block is checked on its own
    cases = [("continuation", prompt, 0), ("edited_middle", edited, 0), ("local_half", prompt, len(prompt) // 2)]
    out = []
    for name, tokens, local in cases:
        digests = PromptDigests.from_tokens(tokens, bs)
        prompt_list = [digests.digest(k) for k in range(digests.num_full_blocks)]

        def ours(digests: PromptDigests = digests, local: int = local) -> Decision:
            return decide(digests, local_hit_tokens=local, handle=handle, now_wall=NOW, config=config)

        def peer(prompt_list: list[bytes] = prompt_list) -> int:
            return naive_first_mismatch(remote_full, prompt_list)

        decision = ours()
        expected = (args.blocks // 2) if name == "edited_middle" else len(remote_full)
        if peer() != expected:
            raise AssertionError(f"{name}: the peer found a mismatch at {peer()}, expected {expected}")
        if decision.action != "fetch" or (name == "edited_middle") != (decision.mismatch_block == expected):
            raise AssertionError(f"{name}: unexpected decision {decision}")
        samples = interleaved_rounds({"decide": ours, "naive_loop": peer}, args.repeat, number=args.number)
        ratios, spreads = speedups(samples, {"decide_vs_naive_loop": ("decide", "naive_loop")})
        times = medians(samples)
        out.append({
            "case": name, "blocks": args.blocks, "action": decision.action, "reason": decision.reason.value,
            "fetch_tokens": decision.fetch_tokens, "mismatch_block": decision.mismatch_block,
            "rounds": args.repeat, "number": args.number,
            "seconds": {k: _sig(v) for k, v in times.items()},
            **ratios, "ratio_spread": spreads,
            "meets_target": times["decide"] * 1e6 <= DECIDE_TARGET_US, "verified": True,
        })
    out.append(_decide_and_claim(args, remote, prompt, config))
    raw_number = max(3, args.number // 50)
    context = medians(interleaved_rounds({
        "decide_from_tokens": lambda: decide(prompt, local_hit_tokens=0, handle=handle, now_wall=NOW, config=config),
        "parse_handle": lambda: parse_handle(params, secret=BENCH_SECRET),
    }, args.repeat, number=raw_number))
    out.append({"case": "context", "blocks": args.blocks, "rounds": args.repeat, "number": raw_number,
                "seconds": {k: _sig(v) for k, v in context.items()}})
    return out


def _decide_and_claim(args: argparse.Namespace, remote: np.ndarray[Any, Any], prompt: np.ndarray[Any, Any],
                      config: PolicyConfig) -> dict[str, Any]:
    """One request's whole bookkeeping: decide, then the decode ledger's claim and complete (digests excluded).

    ``decide`` and ``claim_complete`` alone are timed in the same rounds (what the request is made of)."""
    from ..retention import RetentionLedger

    bs = args.block_size
    ledger = RetentionLedger("bench", "127.0.0.1", 5600)
    handle = ledger.retain("r", range(len(remote) // bs + 1), block_digests(remote, bs), len(remote), bs)
    digests = PromptDigests.from_tokens(prompt, bs)

    def decide_only() -> Decision:
        return decide(digests, local_hit_tokens=0, handle=handle, now_wall=handle.issued_at, config=config)

    count = len(decide_only().fetch_blocks)

    def claim_complete(count: int) -> None:
        claim = ledger.claim(handle.handle_id, handle.generation, handle.block_ids[:count], handle.digests[:count])
        ledger.complete(claim.claim_id)

    def request() -> None:
        claim_complete(len(decide_only().fetch_blocks))

    request()
    samples = interleaved_rounds({"decide+claim+complete": request, "decide": decide_only,
                                  "claim+complete": lambda: claim_complete(count)}, args.repeat, number=args.number)
    times = medians(samples)
    hits = ledger.metrics()["hits"]
    return {"case": "decide+claim+complete", "blocks": args.blocks, "action": "fetch", "reason": "fetch",
            "fetch_tokens": count * bs, "mismatch_block": None, "rounds": args.repeat, "number": args.number,
            "seconds": {k: _sig(v) for k, v in times.items()},
            "meets_target": times["decide+claim+complete"] * 1e6 <= DECIDE_TARGET_US, "verified": hits > 0}


DIGEST_PAIRS = {"ours_numpy_vs_vllm_sha256_pickle": ("ours_numpy", "vllm_sha256_pickle"),
                "ours_numpy_vs_naive_blake2b": ("ours_numpy", "naive_blake2b")}


def _digest_case(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    bs = args.block_size
    arr = rng.integers(0, 150_000, size=args.blocks * bs)
    lst = arr.tolist()
    blocks = args.blocks
    repeat = max(5, args.repeat // 2)
    if naive_blake2b_digests(lst, bs) != block_digests(arr, bs) or block_digests(lst, bs) != block_digests(arr, bs):
        raise AssertionError("the naive blake2b peer or the list input computes a different chain")
    samples = interleaved_rounds({
        "ours_numpy": lambda: block_digests(arr, bs),
        "ours_list": lambda: block_digests(lst, bs),
        "vllm_sha256_pickle": lambda: vllm_style_digests(lst, bs),
        "naive_blake2b": lambda: naive_blake2b_digests(lst, bs),
    }, repeat)
    times = medians(samples)
    ratios, spreads = speedups(samples, DIGEST_PAIRS)
    ns = {name: round(t / blocks * 1e9, 1) for name, t in times.items()}
    return {
        "case": "digest_chain", "block_size": bs, "blocks": blocks, "rounds": repeat, "number": 1,
        "seconds": {k: _sig(v) for k, v in times.items()}, "ns_per_block": ns,
        **ratios, "ratio_spread": spreads,
        "meets_target": ns["ours_numpy"] <= DIGEST_TARGET_NS, "verified": True,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    results = [*_decide_cases(args, rng), _digest_case(args, rng)]
    note = (f"{args.repeat} rounds, methods interleaved; decide: {args.number} calls per round; seconds per call; "
            "naive_loop = the per-block Python comparison alone (a lower bound for a decide built on it)")
    summary = {"targets": {"decide_us": DECIDE_TARGET_US, "digest_ns_per_block": DIGEST_TARGET_NS},
               "meets_targets": all(r["meets_target"] for r in results if "meets_target" in r)}
    return envelope("policy", args, add_arguments, results, note=note, started=started, summary=summary)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'case':22} {'blocks':>6} {'action':>7} {'decide us':>10} {'naive loop us':>14} "
             f"{'decide_vs_naive_loop':>22}"]
    for r in result["results"]:
        t = r["seconds"]
        if r["case"] == "context":
            lines.append(f"decide from token ids (digesting included): {_us(t['decide_from_tokens'])} us; "
                         f"parse_handle: {_us(t['parse_handle'])} us")
        elif r["case"] == "decide+claim+complete":
            lines.append(f"{r['case']:22} {r['blocks']:>6} {r['action']:>7} {_us(t['decide+claim+complete']):>10.2f}"
                         f"   (decide {_us(t['decide'])} us + claim+complete {_us(t['claim+complete'])} us, "
                         "timed alone in the same rounds)")
        elif r["case"] == "digest_chain":
            lines.append(f"digests, ns per {r['block_size']}-token block: " + ", ".join(
                f"{k} {v}" for k, v in r["ns_per_block"].items()) + "; " + ", ".join(
                f"{p} {r[p]:.2f}" for p in DIGEST_PAIRS))
        else:
            sp = r["ratio_spread"]["decide_vs_naive_loop"]
            cell = f"{r['decide_vs_naive_loop']:.2f} ({sp['min']:.2f}-{sp['max']:.2f})"
            lines.append(f"{r['case']:22} {r['blocks']:>6} {r['action']:>7} {_us(t['decide']):>10.2f} "
                         f"{_us(t['naive_loop']):>14.2f} {cell:>22}")
    targets = result["summary"]["targets"]
    lines.append(f"targets: decide <= {targets['decide_us']} us, digest <= {targets['digest_ns_per_block']} ns/block; "
                 f"met: {result['summary']['meets_targets']}; {result['machine']['cpus']} CPUs; {result['note']}")
    return "\n".join(lines)
