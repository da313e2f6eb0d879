"""The engine child process: one offline ``vllm.LLM`` serving requests from its parent over a socket.

Run as a script by :class:`kvshuttle.bench.e2e.engines.VllmEngine` (``python _child.py --fd N --spec JSON``)
in its own session, so the parent can kill the whole process group (this process, vLLM's EngineCore and its
worker) in one signal. The module imports only the standard library at top level: vLLM's spawned children
re-import ``__main__`` (this file), and must not pay for, or trip over, anything here.

Messages are pickled dicts over ``multiprocessing.connection.Connection``:

* ``{"op": "generate", "prompt_token_ids": [...], "max_tokens": n, "kv_transfer_params": dict | None,
  "logprobs": k, "ignore_eos": bool}`` -> ``{"ok": True, "result": {...}}`` (see ``_generate``);
* ``{"op": "keep_stepping", "interval_s": float | None}``: while idle, run a 1-token filler request every
  ``interval_s`` seconds (``None`` stops it);
* ``{"op": "kv_usage"}``: run one filler step (pending frees land, the gauges refresh), then return vLLM's
  ``kv_cache_usage_perc`` and kvshuttle's ``retained_blocks`` gauges (and its tiers', ``TIER_METRICS``, ``DISK_...``);
* ``{"op": "script", "steps": [...]}``: several requests interleaved (see ``_Server.script``);
* ``{"op": "metrics"}``: vLLM's counters and gauges by name (``num_preemptions``, ``kv_cache_usage_perc``, ...);
* ``{"op": "rpc", "method": name, "args": [...]}``: vLLM's ``collective_rpc`` of a worker method by name (one answer
  per rank; e.g. ``kv_probe.KVProbe``'s, added with ``worker_extension_cls``);
* ``{"op": "reset_prefix_cache"}``, ``{"op": "ping"}``, ``{"op": "close"}``.

Errors come back as ``{"ok": False, "error": str, "traceback": str}``; the child keeps serving.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

_FILLER_PROMPT = [5]  # any non-special token id: a 1-token prompt, a 1-token answer
# The connector's tier metrics (gauges: blocks, bytes; counters: demotions, reads, misses): tier "host" under these
# names, tier "disk" as ``kvshuttle_disk_tier_*``
TIER_METRICS = tuple(f"kvshuttle_tier_{what}" for what in ("blocks", "bytes", "demotions", "reads", "misses"))
DISK_TIER_METRICS = tuple(name.replace("kvshuttle_", "kvshuttle_disk_") for name in TIER_METRICS)


class _Server:
    """Owns the ``LLM`` and answers the parent's requests, one at a time."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM  # type: ignore[import-not-found, unused-ignore]
        from vllm.config import KVTransferConfig  # type: ignore[import-not-found, unused-ignore]

        kwargs: dict[str, Any] = dict(
            model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"], block_size=spec["block_size"],
            enforce_eager=True, enable_prefix_caching=spec["enable_prefix_caching"],
            max_model_len=spec["max_model_len"], seed=spec["seed"], disable_log_stats=False,
        )
        if spec.get("max_num_batched_tokens"):
            kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        if spec.get("max_num_seqs"):
            kwargs["max_num_seqs"] = spec["max_num_seqs"]
        if spec.get("kv_transfer_config") is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
        kwargs.update(spec.get("llm_kwargs") or {})
        self.llm = LLM(**kwargs)
        self.keep_stepping_s: float | None = spec.get("keep_stepping_s")
        self.fillers = 0

    # -------------------------------------------------------------------------------------------- requests
    def _run(self, prompt_token_ids: list[int], params: Any, cache_salt: str | None = None) -> tuple[Any, float]:
        """Submit one request and step the engine until it finishes; returns (final output, seconds).
        ``cache_salt``: vLLM's per-request prefix-cache isolation (a salted request hits no other's blocks)."""
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found, unused-ignore]

        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        # enqueue returns the internal id ("<n>-<hex>"); outputs carry the external one ("<n>"). One request
        # is in flight at a time, so the finished output is ours; never step an engine with nothing to do
        # (step() blocks on EngineCore's output queue).
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        self.llm.enqueue(prompt, params, use_tqdm=False)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        if final is None:
            raise RuntimeError("the engine finished the request without a final output")
        return final, time.perf_counter() - t0

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One request: greedy, ``max_tokens`` tokens, optional ``kv_transfer_params``.

        Times: ``latency_s`` is this process's wall time from submission to the finished output;
        ``ttft_s`` is vLLM's front-end first-token latency (arrival to the first token's output processed,
        ``RequestStateStats.first_token_latency``); ``engine_ttft_s`` is EngineCore's own queued-to-first-token
        time (``first_token_ts - queued_ts``, both ``time.monotonic`` in the EngineCore process, so without
        the front end's IPC); ``engine_queue_s`` is queued-to-scheduled.
        """
        out, latency = self._run(msg["prompt_token_ids"], _sampling(msg), msg.get("cache_salt"))
        return _result(out, latency)

    def script(self, steps: list[dict[str, Any]]) -> dict[str, Any]:
        """Several requests at once, as a client would interleave them: ``steps`` run in order, each one of
        ``{"do": "add", "id": str, <generate's fields>}`` (queued, not waited for), ``{"do": "sleep", "s": float}``
        (EngineCore keeps stepping on its own meanwhile), ``{"do": "abort", "id": str}`` and ``{"do": "wait", "id":
        str}`` (until that request finished). Then every request is waited for; returns ``{id: result}`` (an
        aborted request's result has ``finish_reason`` "abort")."""
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found, unused-ignore]

        engine = self.llm.llm_engine
        started: dict[str, float] = {}
        done: dict[str, Any] = {}

        def pump(until: str | None) -> None:
            while (until is None or until not in done) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = _result(out, time.perf_counter() - started[out.request_id])

        for step in steps:
            action = step["do"]
            if action == "add":
                prompt = TokensPrompt(prompt_token_ids=list(step["prompt_token_ids"]))
                if step.get("cache_salt"):
                    prompt["cache_salt"] = step["cache_salt"]
                started[step["id"]] = time.perf_counter()
                engine.add_request(step["id"], prompt, _sampling(step))
            elif action == "sleep":
                time.sleep(float(step["s"]))
            elif action == "abort":  # an aborted request has no final output: its result says so
                engine.abort_request([step["id"]])
                done.setdefault(step["id"], {"request_id": step["id"], "finish_reason": "abort", "token_ids": []})
            elif action == "wait":
                pump(step["id"])
            else:
                raise ValueError(f"unknown script step {action!r}")
        pump(None)
        return done

    def warmup(self, n: int) -> float:
        """Run an ``n``-token prompt and a short decode asking for logprobs, then reset the prefix cache.

        The logprobs matter: vLLM's ``batched_count_greater_than`` (``v1/sample/ops/logprobs.py:10``) is
        ``torch.compile``d even in eager mode, so an engine's first request with logprobs pays an inductor
        compile (4-10 s here). Returns seconds.
        """
        from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

        t0 = time.perf_counter()
        if n > 0:
            vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
            prompt = [4 + (i * 7919) % (vocab - 4) for i in range(n)]  # ids >= 4: no special tokens
            self._run(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True))
            self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def filler(self) -> None:
        """A 1-token request with no transfer parameters: makes the engine step once more."""
        from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

        self._run(_FILLER_PROMPT, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        self.fillers += 1

    def kv_usage(self) -> dict[str, float | None]:
        """vLLM's KV cache usage (1 - free blocks / blocks) and kvshuttle's retained blocks, after one step."""
        self.filler()
        gauges: dict[str, float | None] = {"kv_cache_usage_perc": None, "kvshuttle_retained_blocks": None,
                                           **dict.fromkeys(TIER_METRICS), **dict.fromkeys(DISK_TIER_METRICS)}
        for metric in self.llm.get_metrics():
            name = metric.name.removeprefix("vllm:")
            if getattr(metric, "labels", {}).get("tier") == "disk":
                name = name.replace("kvshuttle_", "kvshuttle_disk_")
            elif getattr(metric, "labels", {}).get("tier", "host") != "host":
                continue
            if name in gauges and gauges[name] is None:
                gauges[name] = float(metric.value)
        return gauges

    # ------------------------------------------------------------------------------------------------ loop
    def serve(self, conn: Connection) -> None:
        while True:
            if not conn.poll(self.keep_stepping_s):  # None: block until a message
                self.filler()
                continue
            try:
                msg = conn.recv()
            except EOFError:
                return
            op = msg.get("op")
            try:
                if op == "generate":
                    reply: dict[str, Any] = {"ok": True, "result": self.generate(msg)}
                elif op == "script":
                    reply = {"ok": True, "result": self.script(msg["steps"])}
                elif op == "keep_stepping":
                    interval = msg.get("interval_s")
                    self.keep_stepping_s = float(interval) if interval else None
                    reply = {"ok": True, "result": {"fillers": self.fillers}}
                elif op == "metrics":  # vLLM's counters and gauges by name (the first of each, engine 0)
                    found: dict[str, float] = {}
                    for metric in self.llm.get_metrics():
                        if isinstance(getattr(metric, "value", None), (int, float)):
                            found.setdefault(metric.name.removeprefix("vllm:"), float(metric.value))
                    reply = {"ok": True, "result": found}
                elif op == "kv_usage":
                    reply = {"ok": True, "result": self.kv_usage()}
                elif op == "rpc":
                    reply = {"ok": True, "result": self.llm.collective_rpc(msg["method"], args=tuple(msg["args"]))}
                elif op == "reset_prefix_cache":
                    reply = {"ok": True, "result": bool(self.llm.reset_prefix_cache())}
                elif op == "ping":
                    reply = {"ok": True, "result": {"pid": os.getpid(), "fillers": self.fillers}}
                elif op == "close":
                    conn.send({"ok": True, "result": None})
                    return
                else:
                    reply = {"ok": False, "error": f"unknown op {op!r}", "traceback": ""}
            except Exception as exc:  # reported to the parent, which decides
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            conn.send(reply)


def _sampling(msg: dict[str, Any]) -> Any:
    """Greedy sampling of ``max_tokens`` tokens, with the message's ``kv_transfer_params`` and ``logprobs``."""
    from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

    extra = {"kv_transfer_params": msg["kv_transfer_params"]} if msg.get("kv_transfer_params") else None
    return SamplingParams(temperature=0.0, max_tokens=int(msg["max_tokens"]), logprobs=msg.get("logprobs"),
                          ignore_eos=bool(msg.get("ignore_eos", True)), extra_args=extra)


def _result(out: Any, latency: float) -> dict[str, Any]:
    """One finished request's output as the parent reads it (see ``_Server.generate``)."""
    comp = out.outputs[0]
    logprobs = [{int(tok): float(lp.logprob) for tok, lp in step.items()} for step in comp.logprobs or ()]
    m = out.metrics
    result: dict[str, Any] = {
        "request_id": out.request_id,
        "token_ids": [int(t) for t in comp.token_ids],
        "finish_reason": comp.finish_reason,
        "kv_transfer_params": _plain(out.kv_transfer_params),
        "num_prompt_tokens": len(out.prompt_token_ids or []),
        "num_cached_tokens": out.num_cached_tokens,
        "first_logprobs": logprobs[0] if logprobs else None,
        "logprobs": logprobs or None,
        "latency_s": latency,
        "ttft_s": None, "engine_ttft_s": None, "engine_queue_s": None,
    }
    if m is not None:
        result["ttft_s"] = float(m.first_token_latency) or None
        if m.first_token_ts and m.queued_ts:
            result["engine_ttft_s"] = float(m.first_token_ts - m.queued_ts)
        if m.scheduled_ts and m.queued_ts:
            result["engine_queue_s"] = float(m.scheduled_ts - m.queued_ts)
    return result


def _watch_parent(parent: int, period_s: float = 1.0) -> None:
    """Kill this process group when the parent is gone (e.g. pytest-timeout's ``os._exit``, a SIGKILL): the
    parent's own clean-up would not run then, and a request stuck in vLLM would keep the group alive."""

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="kvshuttle-parent-watch", daemon=True).start()


def _plain(value: Any) -> Any:
    """JSON-like copy (vLLM returns msgpack-decoded params: lists, dicts, numbers, strings)."""
    return json.loads(json.dumps(value)) if value is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fd", type=int, required=True, help="inherited socket for the parent's messages")
    ap.add_argument("--spec", required=True, help="engine spec as JSON (EngineSpec.to_child)")
    ap.add_argument("--parent", type=int, default=None, help="kill the group when this pid is no longer our parent")
    args = ap.parse_args(argv)
    if args.parent is not None:
        _watch_parent(args.parent)
    conn = Connection(args.fd)
    t0 = time.perf_counter()
    try:
        try:
            spec = json.loads(args.spec)
            server = _Server(spec)
            startup = time.perf_counter() - t0
            warmup = server.warmup(int(spec.get("warmup_tokens") or 0))
        except BaseException as exc:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
            return 1
        conn.send({"ok": True, "result": {"pid": os.getpid(), "startup_s": startup, "warmup_s": warmup}})
        server.serve(conn)  # returns on "close" or when the parent's end of the socket is gone
        return 0
    finally:
        sys.stdout.flush()
        # vLLM's EngineCore and worker outlive an exiting front end (observed: reparented to init, still
        # running), so take the whole group down; the parent does the same after a "close" or a failure.
        os.killpg(0, signal.SIGKILL)

if __name__ == "__main__":
    sys.exit(main())
