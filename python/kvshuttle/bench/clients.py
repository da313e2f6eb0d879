"""``kvshuttle bench clients``: real Claude Code sessions replayed by a real client (aiperf) through the router.

One served deployment (the tiny Llama: a prefill with its prefix cache off, so every reused token is a reverse
read, and a decode; both with ``kvshuttle_content_index`` in a local ``redis-server``, which is also the
router's store) is started once; ``kvshuttle router`` is restarted per row (fresh metrics), and each row runs
``aiperf profile`` (0.13.0, its own venv, offline with the model's tokenizer registered in a local HF cache) on
the first sessions of ``aiperf-sessions/kvcachetester_128k_40sessions.aiperf.jsonl``, lengths capped for the
tiny model, a different ``--random-seed`` per row (different prompts: no row finds another's blocks). Rows:

* ``body``: ``conversation_id`` in every request body (the trace's ``extra``);
* ``header``: no body key; aiperf names the session only by ``--session-header X-Session-ID``;
* ``none``: no key the router reads (aiperf's X-Session-Affinity turned off; it still sends X-Correlation-ID,
  which no router default reads): reuse only through the content index;
* ``dropped``: the body key on the first ``--keyed-turns`` turns of each session only (aiperf sends a turn's
  ``extra`` per turn), no header;
* ``recompute``: the body row's keys with ``--no-reverse-reads``: the TTFT every later turn would pay;
* ``tier``: the body row with ``--tier-delay-ms`` before each later turn, past the decode's hot TTL
  (``--hot-ttl``): every history has moved to the decode's host tier (``--tier-blocks``) and is read back from
  there (the other rows' short gaps stay within the hot TTL);
* ``disk``: the same with ``--disk-delay-ms``, past the host tier's TTL too (``--tier-ttl``): every history has
  moved on into the decode's disk tier (``--disk-bytes`` of files) and is read back from its file.

No row for vLLM's own ``OffloadingConnector``: its CPU tier refuses to start on a CPU engine (``CPUOffloadingSpec.
get_worker``: "only supported on CUDA-alike and XPU GPUs"; benchmarks/README.md has the evidence).

Per row: turns, later turns that reused (the prefill's ``kvshuttle: request ... read N tokens`` log lines),
tokens read back, the router's own counts, TTFT p50 from aiperf's ``profile_export_aiperf.json``, reused turns
over the body row's, TTFT over the recompute row's, and a sample of answers (each session's last turn from
aiperf's raw export, greedy) compared with the prefill answering the same messages alone, cache bypassed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .schema import envelope

TRACE = "aiperf-sessions/kvcachetester_128k_40sessions.aiperf.jsonl"
ROWS: dict[str, dict[str, Any]] = {
    "body": {"key": "body", "router": [], "aiperf": []},
    "header": {"key": None, "router": [], "aiperf": ["--session-header", "X-Session-ID"]},
    "none": {"key": None, "router": [], "aiperf": []},
    "dropped": {"key": "some", "router": [], "aiperf": []},
    "recompute": {"key": "body", "router": ["--no-reverse-reads"], "aiperf": []},
    "tier": {"key": "body", "router": [], "aiperf": [], "paused": "tier"},
    "disk": {"key": "body", "router": [], "aiperf": [], "paused": "disk"},
}
TIER_METRIC = re.compile(r"^vllm:kvshuttle_tier_(reads|demotions|misses)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$",
                         re.MULTILINE)
TIER_LABEL = re.compile(r'tier="(\w+)"')
READ_LINE = re.compile(r"kvshuttle: request (\S+) read (\d+) tokens")
DEFAULT_AIPERF = Path.home() / ".cache" / "kvshuttle-aiperf" / "venv" / "bin" / "aiperf"
HF_REV = "0" * 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--traces", default="../shared/data/traces", help="the traces folder")
    parser.add_argument("--sessions", type=int, default=3, help="the trace's first N sessions")
    parser.add_argument("--turns", type=int, default=4, help="each session's first N turns")
    parser.add_argument("--first-tokens", type=int, default=512, help="cap on a session's first prompt")
    parser.add_argument("--turn-tokens", type=int, default=96, help="cap on a later turn's new tokens")
    parser.add_argument("--answer-tokens", type=int, default=16, help="cap on every answer")
    parser.add_argument("--delay-ms", type=int, default=300, help="gap before a later turn (the trace's: seconds)")
    parser.add_argument("--hot-ttl", type=float, default=4.0,
                        help="the decode's decoder_kv_blocks_ttl (s); then its host tier holds a history")
    parser.add_argument("--tier-blocks", type=int, default=2048, help="the decode's host tier, in KV blocks")
    parser.add_argument("--tier-delay-ms", type=int, default=8000, help="the tier row's gap before a later turn")
    parser.add_argument("--tier-ttl", type=float, default=10.0, help="the host tier's TTL (s); then the disk tier's")
    parser.add_argument("--disk-bytes", type=int, default=1 << 30, help="the decode's disk tier (0: none)")
    parser.add_argument("--disk-delay-ms", type=int, default=20000, help="the disk row's gap before a later turn")
    parser.add_argument("--keyed-turns", type=int, default=2, help="dropped: turns that carry the key")
    parser.add_argument("--aiperf", default=str(DEFAULT_AIPERF), help="aiperf 0.13.0's executable")
    parser.add_argument("--model", default="", help="model directory (default: the tiny random Llama, built here)")
    parser.add_argument("--log-dir", default="")


def convert(rows: list[dict[str, Any]], *, sessions: int, turns: int, first_tokens: int, turn_tokens: int,
            answer_tokens: int, delay_ms: int, key: str | None, keyed_turns: int, prefix: str
            ) -> list[dict[str, Any]]:
    """The trace's first ``sessions`` sessions, ``turns`` turns each, lengths capped (the tiny model holds
    4k tokens), as aiperf ``mooncake_trace`` rows. ``key``: ``body`` (every turn's ``extra`` carries
    ``conversation_id``), ``some`` (the first ``keyed_turns`` turns only), None (no key in any body).
    ``prefix`` makes the session ids and conversation ids unique to a row."""
    order: list[str] = []
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        sid = str(row["session_id"])
        if sid not in by_session:
            if len(order) == sessions:
                continue
            order.append(sid)
            by_session[sid] = []
        by_session[sid].append(row)
    out = []
    for sid in order:
        for k, row in enumerate(by_session[sid][:turns]):
            new = {"session_id": f"{prefix}-{sid}",
                   "input_length": max(1, min(int(row["input_length"]), first_tokens if k == 0 else turn_tokens)),
                   "output_length": max(1, min(int(row.get("output_length", answer_tokens)), answer_tokens))}
            new.update({"timestamp": 0} if k == 0 else {"delay": delay_ms})
            if key == "body" or (key == "some" and k < keyed_turns):
                new["extra"] = {"conversation_id": f"{prefix}-{sid}"}
            out.append(new)
    return out


def read_lines(log_text: str) -> list[int]:
    """Tokens of every reverse read the prefill logged (one line per read)."""
    return [int(m.group(2)) for m in READ_LINE.finditer(log_text)]


def tier_counts(prometheus_text: str) -> dict[str, float]:
    """The decode's tier counters (reads, demotions, misses) from its ``/metrics`` text, summed over labels, and
    per tier (``host_reads``, ``disk_reads``...)."""
    counts = {"reads": 0.0, "demotions": 0.0, "misses": 0.0}
    for m in TIER_METRIC.finditer(prometheus_text):
        counts[m.group(1)] += float(m.group(3))
        tier = TIER_LABEL.search(m.group(2) or "")
        if tier is not None:
            key = f"{tier.group(1)}_{m.group(1)}"
            counts[key] = counts.get(key, 0.0) + float(m.group(3))
    return counts


def ttft_p50_ms(profile: dict[str, Any]) -> float | None:
    """TTFT p50 in ms from aiperf's ``profile_export_aiperf.json`` (its metric records, in whichever of the
    two layouts: top-level ``time_to_first_token`` or a ``records`` list)."""
    stat = profile.get("time_to_first_token")
    if stat is None:
        for rec in profile.get("records", []) if isinstance(profile.get("records"), list) else []:
            if rec.get("tag") == "time_to_first_token":
                stat = rec
    if not isinstance(stat, dict) or stat.get("p50") is None:
        return None
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}.get(str(stat.get("unit", "ms")), 1.0)
    return round(float(stat["p50"]) * scale, 2)


def summarise(results: list[dict[str, Any]]) -> None:
    """In place: reused turns over the body row's, later turns' TTFT over the recompute row's (``_over_``: a
    ratio of one number each, not the schema's per-round ``_vs_`` speedups), and the schema's ``seconds``
    (later turns' TTFT median) and ``rounds`` (later turns)."""
    body = next((r for r in results if r["row"] == "body"), None)
    recompute = next((r for r in results if r["row"] == "recompute"), None)
    for r in results:
        reused = body["reused_turns"] if body else 0
        r["reused_over_body"] = round(r["reused_turns"] / reused, 3) if reused else None
        base = recompute["later_ttft_p50_ms"] if recompute else None
        mine = r["later_ttft_p50_ms"]
        r["ttft_over_recompute"] = round(mine / base, 3) if base and mine else None
        r["seconds"] = {"ttft_median": round(mine / 1e3, 4)} if mine else {}
        r["rounds"] = max(1, int(r["later_turns"]))


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'row':<10} {'turns':>5} {'later':>5} {'reused':>6} {'tokens read':>11} {'vs body':>7} "
             f"{'TTFT p50 ms':>11} {'later p50':>9} {'vs recompute':>12} {'answers = recompute':>19}"]
    for r in result["results"]:
        same = f"{r['answers_equal']}/{r['answers_checked']}"
        lines.append(f"{r['row']:<10} {r['turns']:>5} {r['later_turns']:>5} {r['reused_turns']:>6} "
                     f"{r['read_tokens']:>11} {r['reused_over_body']!s:>7} {r['ttft_p50_ms']!s:>11} "
                     f"{r['later_ttft_p50_ms']!s:>9} {r['ttft_over_recompute']!s:>12} {same:>19}")
    lines.append("(reused: later turns whose prefill read KV back; tokens: read back in all; vs body: reused turns "
                 "over the body row's; answers: each session's last turn against the prefill alone, greedy)")
    return "\n".join(lines)


# --- the live run (needs vLLM, redis-server and aiperf) -----------------------------------------------------


class RedisServer:
    """A throwaway ``redis-server`` on a free port (no persistence)."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        from .e2e.engines import free_port

        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if b"PONG" in s.recv(64):
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def hf_home(model: str, folder: Path) -> Path:
    """A Hugging Face cache holding the model's tokenizer as ``local/tok`` (aiperf resolves tokenizers through
    the hub cache even offline; a plain directory fails)."""
    home = folder / "hfhome"
    repo = home / "hub" / "models--local--tok"
    snap = repo / "snapshots" / HF_REV
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(HF_REV)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model) / name, snap / name)
    return home


def raw_turns(lines: list[str]) -> list[dict[str, Any]]:
    """Per request of aiperf's ``profile_export_raw.jsonl``: session, turn index, messages, max tokens, the
    streamed answer, and TTFT in ms (the first chunk with content, after the request started)."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        meta, payload = rec.get("metadata") or {}, rec.get("payload") or {}
        parts, first = [], None
        for resp in rec.get("responses") or []:
            for packet in resp.get("packets") or []:
                try:
                    chunk = json.loads(packet.get("value") or "")
                except json.JSONDecodeError:  # "[DONE]"
                    continue
                for choice in chunk.get("choices") or [] if isinstance(chunk, dict) else []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and first is None:
                        first = resp["perf_ns"]
                    parts.append(text)
        out.append({"session": str(meta.get("conversation_id") or meta.get("x_correlation_id")),
                    "turn": int(meta.get("turn_index", 0)), "messages": payload.get("messages") or [],
                    "max_tokens": payload.get("max_completion_tokens") or payload.get("max_tokens"),
                    "answer": "".join(parts), "status": rec.get("status"),
                    "ttft_ms": round((first - rec["start_perf_ns"]) / 1e6, 2) if first else None})
    return out


def later_ttft_p50_ms(turns: list[dict[str, Any]]) -> float | None:
    """TTFT p50 of the turns after each session's first (those that can reuse)."""
    values = [t["ttft_ms"] for t in turns if t["turn"] > 0 and t["ttft_ms"] is not None]
    return round(statistics.median(values), 2) if values else None


def last_turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each session's last turn (the one whose history is longest: the sample checked against a recompute)."""
    last: dict[str, dict[str, Any]] = {}
    for t in turns:
        if t["session"] not in last or t["turn"] > last[t["session"]]["turn"]:
            last[t["session"]] = t
    return list(last.values())


def _recompute(prefill_url: str, messages: list[dict[str, Any]], tokens: int, salt: str) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": salt}
    req = urllib.request.Request(prefill_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as reply:
        return str(json.loads(reply.read())["choices"][0]["message"]["content"] or "")


def aiperf_profile(aiperf: str, url: str, data: Path, artifacts: Path, seed: int, log: Path, home: Path, *,
                   affinity: bool = True, extra: list[str] | None = None) -> int:
    """``aiperf profile`` of the ``mooncake_trace`` rows in ``data`` against ``url`` (streamed chat, greedy,
    ``ignore_eos``, raw export into ``artifacts``), offline on the tokenizer :func:`hf_home` registered; its exit
    code. ``affinity`` False turns aiperf's X-Session-Affinity header off (then only a header named on purpose, or
    none, names the session)."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not affinity:
        env["AIPERF_HTTP_X_SESSION_AFFINITY_FROM_CORRELATION_ID"] = "false"
    argv = [aiperf, "profile", "--model", "tiny", "--tokenizer", "local/tok", "--url", url,
            "--endpoint-type", "chat", "--streaming", "--input-file", str(data),
            "--custom-dataset-type", "mooncake_trace", "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", "temperature:0", "--random-seed", str(seed), "--export-level", "raw",
            "--artifact-dir", str(artifacts), "--ui-type", "none", *(extra or [])]
    with open(log, "wb") as out:
        return subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode


def prefill_reads(log_path: Path, offset: int) -> list[int]:
    """Tokens of each reverse read the prefill logged after byte ``offset`` of its log."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        return read_lines(f.read())


def aiperf_turns(artifacts: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """aiperf's ``profile_export_aiperf.json`` (or {}) and its raw export's turns (:func:`raw_turns`)."""
    profile_path = next(artifacts.rglob("profile_export_aiperf.json"), None)
    raw_path = next(artifacts.rglob("profile_export_raw.jsonl"), None)
    return (json.loads(profile_path.read_text()) if profile_path else {},
            raw_turns(raw_path.read_text().splitlines()) if raw_path else [])


class Deployment:
    """One prefill (prefix cache off, core 0) and one decode (core 1) ``vllm serve``, both with the content index in
    a throwaway redis-server (also the router's store); the decode keeps a finished request's blocks ``hot_ttl``
    seconds, then in a host tier of ``tier_blocks`` blocks (0: none) for ``tier_ttl`` seconds (None: the default);
    ``decode_extra``: more of the decode's connector options. :meth:`start`, then :meth:`close`."""

    def __init__(self, model: str, logs: Path, *, hot_ttl: float, tier_blocks: int, tier_ttl: float | None = None,
                 disk_bytes: int = 0, decode_extra: dict[str, Any] | None = None) -> None:
        from .e2e.engines import free_port, shuttle_transfer_config
        from .e2e.serve import ServedEngine, ServeSpec

        self.redis = RedisServer(logs)
        self.kv_port = free_port()
        # aiperf's own processes oversubscribe the cores: the README's advice, a longer heartbeat timeout
        index: dict[str, Any] = {"kvshuttle_content_index": self.redis.url, "kvshuttle_content_index_wait_s": 1.0,
                                 "kvshuttle_peer_timeout_s": 10.0}
        tier: dict[str, Any] = {"decoder_kv_blocks_ttl": hot_ttl, **(decode_extra or {})}
        if tier_blocks:
            tier["kvshuttle_host_tier_blocks"] = tier_blocks
            if tier_ttl is not None:
                tier["kvshuttle_host_tier_ttl_s"] = tier_ttl
            if disk_bytes:  # its files under the logs, in a directory of the decode's own
                (logs / "disk-tier").mkdir(exist_ok=True)
                tier.update(kvshuttle_disk_tier_bytes=disk_bytes, kvshuttle_disk_tier_dir=str(logs / "disk-tier"))
        self.prefill = ServedEngine(ServeSpec(model=model, name="prefill", enable_prefix_caching=False,
                                              cpu_cores=(0,), kv_transfer_config=shuttle_transfer_config(**index),
                                              log_path=str(logs / "prefill.log")))
        self.decode = ServedEngine(ServeSpec(
            model=model, name="decode", cpu_cores=(1 % (os.cpu_count() or 1),),
            kv_transfer_config=shuttle_transfer_config(kvshuttle_port=self.kv_port, **index, **tier),
            log_path=str(logs / "decode.log")))

    def start(self) -> Deployment:
        try:
            for engine in (self.prefill, self.decode):
                engine.launch()
            for engine in (self.prefill, self.decode):
                engine.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def router(self, log: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
        """``kvshuttle router`` in front of both engines, on the same redis store (process, URL)."""
        from .e2e.deployment import start_router

        return start_router([self.prefill], self.decode, self.kv_port, log,
                            ["--store", "redis", "--redis-url", self.redis.url, *extra])

    def close(self) -> None:
        for engine in (self.prefill, self.decode):
            engine.close()
        self.redis.stop()


def _run_row(name: str, seed: int, args: argparse.Namespace, trace: list[dict[str, Any]], deployment: Deployment,
             logs: Path, home: Path) -> dict[str, Any]:
    from .e2e.deployment import router_counts
    from .e2e.engines import kill_group

    prefill, decode = deployment.prefill, deployment.decode
    spec = ROWS[name]
    rows = convert(trace, sessions=args.sessions, turns=args.turns, first_tokens=args.first_tokens,
                   turn_tokens=args.turn_tokens, answer_tokens=args.answer_tokens,
                   delay_ms={"tier": args.tier_delay_ms, "disk": args.disk_delay_ms}.get(spec.get("paused", ""),
                                                                                        args.delay_ms),
                   key=spec["key"], keyed_turns=args.keyed_turns, prefix=f"{name}{seed}")
    data = logs / f"{name}.aiperf.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    router, url = deployment.router(logs / f"router-{name}.log", spec["router"])
    log_path = Path(prefill.spec.log_path or "")
    offset = log_path.stat().st_size
    tier_before = tier_counts(decode.metrics())
    artifacts = logs / f"aiperf-{name}"
    try:
        # only the header named on purpose (or none) names the session in the other rows
        code = aiperf_profile(args.aiperf, url, data, artifacts, seed, logs / f"aiperf-{name}.log", home,
                              affinity=name in ("body", "recompute"), extra=spec["aiperf"])
        sessions = router_counts(url, "session_keys", "source")
        tier_after = tier_counts(decode.metrics())
        placements = router_counts(url)
    finally:
        kill_group(router.pid)
    reads = prefill_reads(log_path, offset)
    profile, turns = aiperf_turns(artifacts)
    samples = last_turns(turns)
    equal = sum(t["answer"] == _recompute(prefill.url, t["messages"], int(t["max_tokens"] or args.answer_tokens),
                                          f"ref-{name}-{i}") for i, t in enumerate(samples))
    return {"row": name, "router_args": spec["router"], "aiperf_args": spec["aiperf"], "aiperf_exit": code,
            "turns": len(rows), "later_turns": len(rows) - args.sessions, "reused_turns": len(reads),
            "read_tokens": sum(reads), "reads": reads, "ttft_p50_ms": ttft_p50_ms(profile),
            "later_ttft_p50_ms": later_ttft_p50_ms(turns), "failed_turns": sum(t["status"] != 200 for t in turns),
            "router_session_keys": {k: int(v) for k, v in sessions.items() if v},
            "router_placements": {k: int(v) for k, v in placements.items() if v},
            "tier": {k: int(tier_after[k] - tier_before.get(k, 0.0)) for k in tier_after},  # labels appear once counted
            "answers_checked": len(samples), "answers_equal": int(equal),
            "verified": bool(samples) and equal == len(samples)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    names = [n for n in args.rows.split(",") if n]
    if unknown := [n for n in names if n not in ROWS]:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if not Path(args.aiperf).exists():
        raise SystemExit(f"aiperf not found at {args.aiperf} (python3 -m venv V && V/bin/pip install aiperf==0.13.0)")
    traces = Path(args.traces)
    trace = [json.loads(line) for line in (traces / TRACE).read_text().splitlines() if line.startswith("{")]
    model = args.model
    if not model:
        from .e2e.tiny_model import assets_root, build_tiny_llama

        model = str(build_tiny_llama(assets_root() / "tiny-llama"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-clients-"))
    logs.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(model, logs, hot_ttl=args.hot_ttl, tier_blocks=args.tier_blocks, tier_ttl=args.tier_ttl,
                            disk_bytes=args.disk_bytes if "disk" in names else 0).start()
    results = []
    try:
        home = hf_home(model, logs)
        for i, name in enumerate(names):
            results.append(_run_row(name, 1000 + i, args, trace, deployment, logs, home))
    finally:
        deployment.close()
    summarise(results)
    note = (f"aiperf 0.13.0 replaying the first {args.sessions} sessions x {args.turns} turns of {TRACE} (lengths "
            f"capped: first prompt {args.first_tokens}, later {args.turn_tokens}, answers {args.answer_tokens} "
            f"tokens) through kvshuttle router; one prefill (prefix cache off, core 0) and one decode (core 1; hot "
            f"TTL {args.hot_ttl:g} s, then a host tier of {args.tier_blocks} blocks for {args.tier_ttl:g} s, then "
            f"{args.disk_bytes if 'disk' in names else 0} bytes of disk tier; the tier row waits "
            f"{args.tier_delay_ms} ms before each later turn, the disk row {args.disk_delay_ms} ms), "
            "vllm serve, tiny random Llama (float32), content index and router store in one redis-server")
    return envelope("clients", args, add_arguments, results, note=note, started=started)
