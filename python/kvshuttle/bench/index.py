"""``kvshuttle bench index``: the content index's lookup (issue 34) at 100,000 indexed retentions on Redis.

A local ``redis-server`` is started (or ``--redis-url`` used), ``--retentions`` retentions are published at
each stride of ``--strides`` (conversations of ``--min-tokens``..``--max-tokens`` tokens, log-uniform, in
16-token blocks), and lookups are timed per case, each interleaved call by call with the physical floor
measured in the same run on the same connection settings: one ``GET`` of one key (a round trip) and one
``MGET`` of as many keys as the lookup asks. Cases: a next turn of a conversation of the mix and of the longest
one (the largest record to bring back), a prompt sharing only a 1k-token preamble, and misses of 2k and 70k
tokens. A lookup's time is all of what the connector pays: its keys' hashes, the round trip (the script picks
the deepest live entry next to the data) and parsing the record.

Block digests are synthetic (a keyed hash of (conversation, block): the index sees only digests, and hashing
100,000 conversations' tokens would time blake2b, not the index). The conversations a case looks up carry real
signed handles of their full size; the others carry small params (Redis memory, not lookup time, depends on them).
``summary.target_met``: every case's p99 within ``--target-ms`` (1 ms: issue 34's bound on admission).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..policy.kv_handle import KVHandle
from ..retention.index import DEFAULT_STRIDE, positions
from ..retention.index.redis_backend import RedisContentIndex
from ..retention.index.scheme import encode_record, lookup_positions
from ..trust import DeploymentSecret
from .schema import envelope
from .timing import speedups

B = 16  # tokens per block
SECRET = DeploymentSecret(b"kvshuttle-bench-index-secret-0123456789abcdef")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retentions", type=int, default=100_000, help="retentions indexed")
    parser.add_argument("--strides", default=str(DEFAULT_STRIDE),
                        help="sparse strides (blocks), comma-separated: one run each")
    parser.add_argument("--min-tokens", type=int, default=2_000)
    parser.add_argument("--max-tokens", type=int, default=70_000)
    parser.add_argument("--lookups", type=int, default=2_000, help="timed lookups per case")
    parser.add_argument("--probes", type=int, default=300, help="conversations per case that carry full handles")
    parser.add_argument("--target-ms", type=float, default=1.0, help="issue 34's p99 bound on a lookup")
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start a local redis-server)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run (5k retentions, 200 lookups)")


class Chain(Sequence[bytes]):
    """Conversation ``conv``'s digest chain, computed only where asked; ``until``: shared with ``base`` that far."""

    def __init__(self, conv: int, blocks: int, base: int | None = None, until: int = 0) -> None:
        self.conv, self.blocks, self.base, self.until = conv, blocks, base, until

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, k: Any) -> Any:
        owner = self.base if self.base is not None and k < self.until else self.conv
        return hashlib.blake2b(f"{owner}:{k}".encode(), digest_size=16).digest()


def _handle_params(conv: int, blocks: int, expiry: float) -> dict[str, Any]:
    chain = Chain(conv, blocks)
    handle = KVHandle(engine_id="decode-0", request_id=f"r{conv}", host="127.0.0.1", port=5600,
                      block_ids=tuple(range(blocks)), num_tokens=blocks * B, expiry_time=expiry, tp_size=1,
                      handle_id=f"h{conv}", generation=1, block_size=B, digests=tuple(chain[k] for k in range(blocks)),
                      issued_at=expiry - 600, ttl_s=600.0)
    return handle.to_kv_transfer_params(SECRET)


def _small_params(conv: int) -> dict[str, Any]:
    return {"kvshuttle_handle_id": f"h{conv}", "kvshuttle_reads": "multi_read", "remote_host": "127.0.0.1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench index needs redis-server (apt-get install redis-server) or --redis-url")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _run_stride(stride: int, url: str, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    import redis

    raw = redis.Redis.from_url(url, socket_timeout=120.0)  # flushing a million keys on a busy machine is slow
    raw.flushdb(asynchronous=True)
    n, started = args.retentions, time.perf_counter()
    low, high = math.log(args.min_tokens), math.log(args.max_tokens)
    sizes = (np.exp(rng.uniform(low, high, size=n)) // B).astype(int)
    longest = args.max_tokens // B
    probes = rng.choice(n, size=min(args.probes, n), replace=False)
    sizes[probes[: max(1, len(probes) // 10)]] = longest  # a tenth of the probes are the longest conversations
    full = set(probes.tolist())
    expiry = time.time() + 3600
    decode = RedisContentIndex(url, SECRET, "127.0.0.1:5600", stride=stride, timeout_s=2.0,
                               max_per_publisher=n + 1)
    decode.start()
    publish_s: list[float] = []
    record_bytes: dict[int | None, int] = {}
    keys = 0
    for conv in range(n):
        blocks = int(sizes[conv])
        params = _handle_params(conv, blocks, expiry) if conv in full else _small_params(conv)
        if conv in full:
            record_bytes[conv] = len(encode_record("scope", "127.0.0.1:5600", "incarnation", expiry, params))
        t0 = time.perf_counter()
        if not decode.publish("tenant", Chain(conv, blocks), params, expiry):
            raise AssertionError(f"retention {conv} was not indexed")
        publish_s.append(time.perf_counter() - t0)
        keys += len(positions(blocks, stride))
    build_s = time.perf_counter() - started
    memory = int(raw.info("memory")["used_memory"])
    reader = RedisContentIndex(url, SECRET, stride=stride, timeout_s=2.0)
    floor = redis.Redis.from_url(url, socket_timeout=2.0)
    probe_list = [int(c) for c in probes]
    long_probes = [c for c in probe_list if sizes[c] == longest]
    cases: list[tuple[str, list[tuple[Chain, str | None, int]]]] = []

    def next_turn(conv: int) -> tuple[Chain, str | None, int]:
        blocks = int(sizes[conv])  # the retention, then a new message of 13 blocks
        at = [p for p in positions(blocks + 13, stride) if p < blocks]
        return Chain(10**9 + conv, blocks + 13, conv, blocks), f"h{conv}", at[-1] + 1

    cases.append(("next_turn_mix", [next_turn(c) for c in probe_list]))
    cases.append(("next_turn_70k", [next_turn(c) for c in long_probes]))
    preamble = 1024 // B
    shallow = [c for c in probe_list if sizes[c] > preamble]
    cases.append(("preamble_1k", [(Chain(2 * 10**9 + c, 512, c, preamble), f"h{c}",
                                   [p for p in positions(512, stride) if p < preamble][-1] + 1) for c in shallow]))
    cases.append(("miss_2k", [(Chain(3 * 10**9 + k, 2_000 // B), None, 0) for k in range(100)]))
    cases.append(("miss_70k", [(Chain(4 * 10**9 + k, longest), None, 0) for k in range(100)]))
    gc.collect()
    gc.freeze()
    results: list[dict[str, Any]] = []
    for name, prompts in cases:
        lookup_s, get_s, mget_s = [], [], []
        for i in range(args.lookups + 20):  # 20 warm-up calls, not counted
            chain, expect, blocks = prompts[i % len(prompts)]
            asked = len(lookup_positions(len(chain), stride))
            probe_keys = reader.names.digest_keys("tenant", chain, range(asked))
            t0 = time.perf_counter()
            match = reader.lookup("tenant", chain)
            t1 = time.perf_counter()
            floor.get(probe_keys[0])
            t2 = time.perf_counter()
            floor.mget(probe_keys)
            t3 = time.perf_counter()
            got = None if match is None else (match.handle_id, match.blocks)
            if got != (None if expect is None else (expect, blocks)):
                raise AssertionError(f"{name}: lookup found {got}, expected {(expect, blocks)}")
            if i >= 20:
                lookup_s.append(t1 - t0)
                get_s.append(t2 - t1)
                mget_s.append(t3 - t2)
        asked = len(lookup_positions(len(prompts[0][0]), stride))
        samples = {"lookup": lookup_s, "get": get_s, "mget": mget_s}
        ratios, spreads = speedups(samples, {"lookup_vs_get": ("lookup", "get"), "lookup_vs_mget": ("lookup", "mget")})
        p = {k: {"p50": _pct(v, 50), "p99": _pct(v, 99)} for k, v in samples.items()}
        results.append({
            "stride": stride, "case": name, "retentions": n, "keys_asked": asked, "rounds": len(lookup_s),
            "record_bytes_mean": round(statistics.mean(record_bytes[c.base] for c, _, _ in prompts))
            if prompts[0][1] else 0,
            "seconds": {f"{k}_{q}": float(f"{v[q]:.6g}") for k, v in p.items() for q in ("p50", "p99")},
            **ratios,
            "ratio_spread": spreads,
            "p99_mget_over_lookup": round(p["mget"]["p99"] / p["lookup"]["p99"], 3),
            "lookup_p99_minus_mget_p99_ms": round((p["lookup"]["p99"] - p["mget"]["p99"]) * 1e3, 3),
            "verified": True,
        })
    gc.unfreeze()
    build = {"stride": stride, "case": "publish", "retentions": n, "rounds": n, "digest_keys": keys,
             "keys_per_retention": round(keys / n, 1), "redis_used_memory_bytes": memory, "build_s": round(build_s, 1),
             "seconds": {"publish_p50": float(f"{_pct(publish_s, 50):.6g}"),
                         "publish_p99": float(f"{_pct(publish_s, 99):.6g}")},
             "verified": True}
    for client in (decode, reader):
        client.close()
    floor.close()
    raw.flushdb(asynchronous=True)
    raw.close()
    return {"build": build, "lookups": results}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, given = time.perf_counter(), args
    if args.quick:
        args = argparse.Namespace(**{**vars(args), "retentions": 5_000, "lookups": 200, "probes": 100})
    strides = [int(s) for s in str(args.strides).split(",") if s]
    if args.retentions < 1 or not strides or min(strides) < 1 or args.min_tokens < B:
        raise SystemExit("bench index: --retentions and --strides must be positive, --min-tokens at least 16")
    proc, url = (None, args.redis_url) if args.redis_url else _start_redis()
    results: list[dict[str, Any]] = []
    try:
        rng = np.random.default_rng(args.seed)
        for stride in strides:
            out = _run_stride(stride, url, args, rng)
            results += [out["build"], *out["lookups"]]
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
    lookups = [r for r in results if r["case"] != "publish"]
    worst = {s: max(r["seconds"]["lookup_p99"] for r in lookups if r["stride"] == s) for s in strides}
    summary = {"worst_p99_ms_by_stride": {str(s): round(v * 1e3, 3) for s, v in worst.items()},
               "target_ms": args.target_ms,
               "target_met": {str(s): v * 1e3 <= args.target_ms for s, v in worst.items()}}
    note = (f"seconds per call: p50/p99 of {args.lookups} lookups per case, each followed by the floor on the same "
            "Redis (one GET round trip, one MGET of the lookup's key count); <a>_vs_<b> = b's time / a's; "
            "synthetic digests, full signed handles for the looked-up conversations only; "
            "client and redis-server on one machine (loopback)")
    if args.quick:
        note += "; --quick: a smoke run"
    return envelope("index", args, add_arguments, results, note=note, started=started, summary=summary,
                    command_args=given)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'stride':>6} {'case':>14} {'keys':>5} {'lookup p50':>11} {'p99':>8} {'GET p50':>8} {'MGET p50':>9} "
             f"{'MGET p99':>9} {'vs MGET':>8}   (microseconds)"]
    for r in result["results"]:
        s = r["seconds"]
        if r["case"] == "publish":
            lines.append(f"{r['stride']:>6} {'publish':>14} {r['keys_per_retention']:>5} "
                         f"{s['publish_p50'] * 1e6:>11.0f} {s['publish_p99'] * 1e6:>8.0f}   "
                         f"{r['digest_keys']:,} keys, redis {r['redis_used_memory_bytes'] / 2**20:.0f} MiB, "
                         f"built in {r['build_s']} s")
            continue
        lines.append(f"{r['stride']:>6} {r['case']:>14} {r['keys_asked']:>5} {s['lookup_p50'] * 1e6:>11.0f} "
                     f"{s['lookup_p99'] * 1e6:>8.0f} {s['get_p50'] * 1e6:>8.0f} {s['mget_p50'] * 1e6:>9.0f} "
                     f"{s['mget_p99'] * 1e6:>9.0f} {r['lookup_vs_mget']:>8.2f}")
    lines.append(f"summary: {result['summary']}; {result['note']}")
    return "\n".join(lines)
