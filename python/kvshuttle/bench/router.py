"""``kvshuttle bench router``: the multi-turn router under load, against fast fake vLLM servers on loopback.

Processes: the fake prefill + decode (``python -m kvshuttle.router.doubles``: answer at once, stream
``--tokens`` SSE chunks, publish each streamed turn's handle on a real kvshuttle side channel), one or more
``kvshuttle router`` processes (one on the memory store; several share a ``redis-server``), and this process,
the load: open-loop arrivals at ``--rate`` requests per second over ``--conversations`` conversations (two
tenants that reuse each other's conversation ids), every request streamed, a conversation's turns sent to the
replicas in turn (so replicas must share the store), each conversation idle until its previous turn ended.

Interleaved with it, at ``--direct-rate``, the same kind of turn sent straight to the backends (prefill, then
the decode's stream, exactly the router's two requests): the router's added latency is router-path minus
direct-path, per percentile, measured in the same run under the same load (``ttft``: to the first chunk;
``total``: to the stream's end). Also: the router's own ``added_latency`` histogram, the routers' RSS at the
start and end of the load, and the handles: every turn after a conversation's first must reach prefill with
the handle of that conversation's previous turn (``lost`` counts those that did not, ``cross_tenant`` those
that came with another conversation's; both must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import deque
from typing import Any

from .schema import envelope

FIRST_TURN = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per case")
    parser.add_argument("--rate", type=float, default=500.0, help="router requests per second (open loop)")
    parser.add_argument("--conversations", type=int, default=1000, help="concurrent conversations (two tenants)")
    parser.add_argument("--replicas", default="1,2",
                        help="router replica counts, one case each: 1 uses the memory store, more share redis")
    parser.add_argument("--direct-rate", type=float, default=50.0,
                        help="direct-to-backend turns per second (the baseline), interleaved with the load")
    parser.add_argument("--tokens", type=int, default=8, help="SSE chunks per answer")
    parser.add_argument("--quick", action="store_true", help="a smoke run (3 s, 50 req/s, 40 conversations)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(argv: list[str], what: str, timeout: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """Start a child in its own process group and return it with its first stdout line."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    if not line or time.monotonic() > deadline:
        _stop(proc)
        raise RuntimeError(f"{what} did not start: {argv}")
    return proc, line.strip()


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return dict(json.loads(resp.read()))


def _metrics(url: str) -> dict[str, float]:
    """Unlabelled and ``result``/``reason``-labelled samples of a router's /metrics, summed by name+label."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvshuttle_router_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _histogram_quantile(metrics: list[dict[str, float]], q: float) -> float | str | None:
    """The q-quantile's bucket upper bound of the routers' added-latency histograms, summed (milliseconds;
    ``">1000"`` past the largest finite bucket)."""
    buckets: dict[float, float] = {}
    for m in metrics:
        for name, value in m.items():
            if name.startswith("kvshuttle_router_added_latency_seconds_bucket{"):
                le = name.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets or not buckets[float("inf")]:
        return None
    total = buckets[float("inf")]
    finite = [b for b in sorted(buckets) if b != float("inf")]
    for bound in finite:
        if buckets[bound] >= q * total:
            return round(bound * 1e3, 3)
    return f">{finite[-1] * 1e3:g}" if finite else None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


class Load:
    """The open-loop load and the direct baseline for one case."""

    def __init__(self, routers: list[str], prefill: str, decode: str, args: argparse.Namespace) -> None:
        self.routers, self.prefill, self.decode, self.args = routers, prefill, decode, args
        self.router_ttft: list[float] = []
        self.router_total: list[float] = []
        self.direct_ttft: list[float] = []
        self.direct_total: list[float] = []
        self.errors: dict[str, int] = {}
        self.sent = self.skipped = self.later_turns = 0
        self.warmup_until = 0.0
        self.pids: list[int] = []
        self.rss_samples: list[list[float]] = []  # router RSS (MiB) every 5 s of the load

    def _error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def run(self) -> None:
        import aiohttp

        args = self.args
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            idle: deque[int] = deque(range(args.conversations))
            turns = [0] * args.conversations
            histories: list[list[dict[str, str]]] = [[] for _ in range(args.conversations)]
            tasks: set[asyncio.Task[None]] = set()
            start = time.perf_counter()
            self.warmup_until = start + min(1.0, args.duration / 5)
            end = start + args.duration
            next_router, next_direct, next_rss = start, start, start
            while True:
                now = time.perf_counter()
                if now >= end:
                    break
                if now >= next_rss:
                    next_rss += 5.0
                    self.rss_samples.append([_rss_mib(pid) for pid in self.pids])
                while next_router <= now:
                    next_router += 1.0 / args.rate
                    if not idle:
                        self.skipped += 1
                        continue
                    conv = idle.popleft()
                    task = asyncio.ensure_future(self._router_turn(session, conv, turns, histories, idle))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while args.direct_rate > 0 and next_direct <= now:
                    next_direct += 1.0 / args.direct_rate
                    task = asyncio.ensure_future(self._direct_turn(session))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(max(0.0, min(next_router, next_direct) - time.perf_counter()))
            if tasks:
                await asyncio.wait(tasks, timeout=60)

    async def _stream(self, session: Any, url: str, body: dict[str, Any], headers: dict[str, str]
                      ) -> tuple[float, float, bytes]:
        """POST a streamed request; (seconds to the first chunk, to the end, the last bytes)."""
        started = time.perf_counter()
        first, tail = 0.0, b""
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            async for chunk in resp.content.iter_any():
                if not first:
                    first = time.perf_counter() - started
                tail = chunk
        return first, time.perf_counter() - started, tail

    async def _router_turn(self, session: Any, conv: int, turns: list[int], histories: list[list[dict[str, str]]],
                           idle: deque[int]) -> None:
        tenant, name = f"t{conv % 2}", f"c{conv // 2}"  # the two tenants reuse each other's conversation ids
        history = histories[conv]
        history.append({"role": "user", "content": f"{tenant}/{name} says hello" if not history else "more"})
        url = self.routers[(conv + turns[conv]) % len(self.routers)] + "/v1/chat/completions"
        body = {"model": "fake", "messages": history, "stream": True, "max_tokens": self.args.tokens}
        headers = {"X-Tenant": tenant, "X-Conversation-Id": name}
        self.sent += 1
        counted = time.perf_counter() >= self.warmup_until
        try:
            ttft, total, tail = await self._stream(session, url, body, headers)
            if b"[DONE]" not in tail or b'"error"' in tail:
                raise RuntimeError("stream did not end cleanly")
            if turns[conv] > 0:
                self.later_turns += 1
            turns[conv] += 1
            history.append({"role": "assistant", "content": "answer"})
            if counted:
                self.router_ttft.append(ttft)
                self.router_total.append(total)
        except Exception as exc:
            self._error(f"router: {type(exc).__name__}: {exc}"[:120])
            history.clear()  # start over: a failed turn's history is not the decode's
            turns[conv] = 0
        finally:
            idle.append(conv)

    async def _direct_turn(self, session: Any) -> None:
        body: dict[str, Any] = {"model": "fake", "messages": [{"role": "user", "content": "direct probe"}],
                                "max_tokens": self.args.tokens}
        counted = time.perf_counter() >= self.warmup_until
        rid = os.urandom(8).hex()
        try:
            started = time.perf_counter()
            prefill = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": FIRST_TURN}
            async with session.post(self.prefill + "/v1/chat/completions", json=prefill,
                                    headers={"X-Request-Id": rid}) as resp:
                params = (await resp.json()).get("kv_transfer_params")
            prefilled = time.perf_counter() - started
            decode = {**body, "stream": True, "kv_transfer_params": params}
            first, _, tail = await self._stream(session, self.decode + "/v1/chat/completions", decode,
                                                {"X-Request-Id": rid})
            total = time.perf_counter() - started
            if counted and b"[DONE]" in tail:
                self.direct_ttft.append(prefilled + first)
                self.direct_total.append(total)
        except Exception as exc:
            self._error(f"direct: {type(exc).__name__}"[:120])


def _case(replicas: int, backends: dict[str, str], backends_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    prefill = backends["prefill"]
    decode_url = backends["decode"].split(",", 1)[0]
    redis: subprocess.Popen[str] | None = None
    store = "memory"
    if replicas > 1:
        binary = shutil.which("redis-server")
        if binary is None:
            return {"case": f"{replicas} replicas, redis", "skipped": "redis-server is not installed"}
        port = _free_port()
        redis = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                  "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                 start_new_session=True)
        time.sleep(0.5)
        store = f"redis://127.0.0.1:{port}/0"
    procs: list[subprocess.Popen[str]] = []
    try:
        urls = []
        for _ in range(replicas):
            proc, line = _spawn([sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", prefill, "--decode",
                                 backends["decode"], "--port", "0", "--store", store, "--tenant-header", "X-Tenant",
                                 "--log-level", "WARNING"], "kvshuttle router")
            procs.append(proc)
            urls.append(line.split()[-1])
        before = {role: _get_json(url.split(",", 1)[0] + "/_stats") for role, url in backends.items()}
        load = Load(urls, prefill, decode_url, args)
        load.pids = [p.pid for p in procs]
        rss_start = [_rss_mib(p.pid) for p in procs]
        cpu_start = [_cpu_s(p.pid) for p in procs] + [_cpu_s(backends_pid), time.process_time()]
        started = time.perf_counter()
        asyncio.run(load.run())
        seconds = time.perf_counter() - started
        cpu_end = [_cpu_s(p.pid) for p in procs] + [_cpu_s(backends_pid), time.process_time()]
        cpu = [b - a for a, b in zip(cpu_start, cpu_end, strict=True)]
        rss_end = [_rss_mib(p.pid) for p in procs]
        after = {role: _get_json(url.split(",", 1)[0] + "/_stats") for role, url in backends.items()}
        metrics = [_metrics(u) for u in urls]
    finally:
        for proc in procs:
            _stop(proc)
        if redis is not None:
            _stop(redis)
    delta = {k: after["prefill"][k] - before["prefill"][k] for k in ("handles_in", "matched", "cross", "lost")}
    lat: dict[str, Any] = {}
    for what in ("ttft", "total"):
        r, d = getattr(load, f"router_{what}"), getattr(load, f"direct_{what}")
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            rq, dq = _pct(r, q), _pct(d, q)
            lat[f"{what}_{label}_ms"] = {"router": rq, "direct": dq,
                                         "added": None if rq is None or dq is None else round(rq - dq, 3)}
    def labelled(prefix: str, label: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in metrics:
            for k, v in m.items():
                if k.startswith(prefix + "{") and f'{label}="' in k and v:
                    name = k.split(f'{label}="', 1)[1].split('"', 1)[0]
                    out[name] = out.get(name, 0) + int(v)
        return out

    lookups = labelled("kvshuttle_router_handle_lookups_total", "result")
    hits = lookups.get("hit", 0)
    return {
        "case": f"{replicas} replica{'s' if replicas > 1 else ''}, {'redis' if replicas > 1 else 'memory'} store",
        "replicas": replicas, "store": "redis" if replicas > 1 else "memory",
        # the schema's names: median seconds per turn of each path, and how many turns were timed
        "seconds": {"router": _median(load.router_total), "direct": _median(load.direct_total)},
        "rounds": len(load.router_total),
        "verified": {"handles": True},  # the fake prefill checked every handle against its conversation
        "requests": load.sent, "completed": len(load.router_total), "rate_achieved": round(load.sent / seconds, 1),
        "skipped_no_idle_conversation": load.skipped, "direct_probes": len(load.direct_total),
        "errors": load.errors, "latency": lat,
        "router_added_latency_histogram_ms": {"p50": _histogram_quantile(metrics, 0.5),
                                              "p99": _histogram_quantile(metrics, 0.99)},
        "rss_mib": {"start": rss_start, "end": rss_end, "every_5s": load.rss_samples},
        # CPU per router request: what bounds the rate on a small machine (routers, fake backends, this load)
        "cpu_ms_per_request": {"routers": round(sum(cpu[:replicas]) / max(1, load.sent) * 1e3, 3),
                               "backends": round(cpu[-2] / max(1, load.sent + len(load.direct_total)) * 1e3, 3),
                               "load": round(cpu[-1] / max(1, load.sent) * 1e3, 3)},
        "cpu_cores_busy": {"routers": round(sum(cpu[:replicas]) / seconds, 2), "backends": round(cpu[-2] / seconds, 2),
                           "load": round(cpu[-1] / seconds, 2)},
        "handles": {"later_turns": load.later_turns, "hits_at_prefill": delta["matched"],
                    "router_hits": int(hits), "lost": delta["lost"], "cross_tenant": delta["cross"],
                    "router_lookups": lookups,
                    "router_unlearned": labelled("kvshuttle_router_handles_unlearned_total", "reason"),
                    "router_store_errors": labelled("kvshuttle_router_store_errors_total", "op")},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    given = argparse.Namespace(**vars(args))
    if args.quick:
        args.duration, args.rate, args.conversations, args.direct_rate = 3.0, 50.0, 40, 10.0
    started = time.perf_counter()
    backends_proc, line = _spawn([sys.executable, "-m", "kvshuttle.router.doubles", "--tokens", str(args.tokens)],
                                 "the fake vLLM servers")
    try:
        backends = json.loads(line)
        results = [_case(int(r), backends, backends_proc.pid, args) for r in str(args.replicas).split(",") if r.strip()]
    finally:
        _stop(backends_proc)
    done = [r for r in results if "skipped" not in r]
    summary = {
        "lost_handles": sum(r["handles"]["lost"] for r in done),
        "cross_tenant_handles": sum(r["handles"]["cross_tenant"] for r in done),
        "p99_added_total_ms": {r["case"]: r["latency"]["total_p99_ms"]["added"] for r in done},
        "p99_added_ttft_ms": {r["case"]: r["latency"]["ttft_p99_ms"]["added"] for r in done},
    }
    note = ("fake backends answer at once (no model); latencies from this process over loopback, all processes "
            "sharing this machine's cores; added = router path minus direct path at the same percentile, the "
            "first second of each case is warm-up and not counted")
    return envelope("router", args, add_arguments, results, note=note, started=started, summary=summary,
                    command_args=given)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'case':<28} {'req/s':>7} {'p50 add':>8} {'p99 add':>8} {'p99 rtr':>8} {'p99 dir':>8} "
             f"{'hist p99':>8} {'rss MiB':>14} {'lost':>5} {'cross':>5} {'errors':>6}"]
    for r in result["results"]:
        if "skipped" in r:
            lines.append(f"{r['case']:<28} skipped: {r['skipped']}")
            continue
        t = r["latency"]
        rss = f"{sum(r['rss_mib']['start']):.0f}->{sum(r['rss_mib']['end']):.0f}"
        lines.append(f"{r['case']:<28} {r['rate_achieved']:>7} {t['total_p50_ms']['added']!s:>8} "
                     f"{t['total_p99_ms']['added']!s:>8} {t['total_p99_ms']['router']!s:>8} "
                     f"{t['total_p99_ms']['direct']!s:>8} {r['router_added_latency_histogram_ms']['p99']!s:>8} "
                     f"{rss:>14} {r['handles']['lost']:>5} {r['handles']['cross_tenant']:>5} "
                     f"{sum(r['errors'].values()):>6}")
    lines.append("(milliseconds; 'add' = router path minus direct path, to the stream's end; 'hist' = the router's "
                 "own added_latency histogram bucket)")
    return "\n".join(lines)
