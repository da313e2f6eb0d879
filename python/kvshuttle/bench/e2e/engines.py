"""One offline vLLM engine per child process, in its own process group, driven over a socket.

``VllmEngine(EngineSpec(...))`` starts ``_child.py`` with ``start_new_session=True``: the child, vLLM's
EngineCore and its worker (vLLM spawns both on CPU) share one process group, and :meth:`VllmEngine.close`
kills that group, always (SIGTERM, then SIGKILL after a grace period). An engine that is not closed is killed
when the interpreter exits, and the child kills its own group when its parent disappears (``os._exit``,
SIGKILL). Every wait has a timeout; a request that times out kills the engine (its state is unknown, and a
later run would otherwise meet "Address already in use" on the NIXL side-channel port).

The environment is the one the project's 2-core CPU machine needs (the shared environment notes):
float32, block size 32, eager mode, ``VLLM_CPU_KVCACHE_SPACE=1``, ``OMP_NUM_THREADS=1``,
``OMP_WAIT_POLICY=PASSIVE``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, and, for a NIXL-based connector,
``kv_connector_extra_config["num_threads"] = 0`` (busy-polling threads oversubscribe two cores). The KV
transfer configuration is a plain ``KVTransferConfig`` dict, so the same harness runs vLLM's ``NixlConnector``,
a third-party connector through ``kv_connector_module_path``, or no connector (``None``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

_CHILD = Path(__file__).with_name("_child.py")

#: Environment every engine gets (the caller's ``EngineSpec.env`` overrides it).
BASE_ENV = {
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


class EngineError(RuntimeError):
    """The engine failed to start, answered with an error, died, or did not answer in time."""


@dataclass
class EngineSpec:
    """How to start one engine. ``kv_transfer_config`` is ``KVTransferConfig``'s fields as a dict, or None.

    ``side_channel_port`` sets ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (two NIXL engines on one host need different
    ports). ``cpu_cores``: after start-up, every thread of every process in the engine's group is pinned to
    these cores (vLLM's NIXL worker pins itself to the last core; on 2 cores two engines then share one).
    ``keep_stepping_s``: while idle, the child runs a 1-token filler request this often. ``warmup_tokens``: a
    request of that many tokens runs before the engine reports ready (the first forward passes of a fresh
    engine are several times slower), then the prefix cache is reset.
    """

    model: str
    name: str = "engine"
    kv_transfer_config: dict[str, Any] | None = None
    enable_prefix_caching: bool = True
    block_size: int = 32
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = 8
    seed: int = 0
    kv_cache_space_gib: int = 1
    side_channel_port: int | None = None
    cpu_cores: tuple[int, ...] | None = None
    keep_stepping_s: float | None = None
    warmup_tokens: int = 0
    env: dict[str, str] = field(default_factory=dict)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    log_path: str | None = None
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 120.0

    def to_child(self) -> str:
        """The JSON the child reads (what ``LLM(...)`` needs)."""
        keys = ("model", "kv_transfer_config", "enable_prefix_caching", "block_size", "dtype", "max_model_len",
                "max_num_batched_tokens", "max_num_seqs", "seed", "keep_stepping_s", "warmup_tokens",
                "llm_kwargs")
        d = asdict(self)
        return json.dumps({k: d[k] for k in keys})


def nixl_transfer_config(*, bidirectional: bool = True, kv_role: str = "kv_both", num_threads: int = 0,
                         **extra: Any) -> dict[str, Any]:
    """vLLM's own ``NixlConnector`` as the CPU machine runs it (``extra`` goes to ``kv_connector_extra_config``,
    e.g. ``kv_recompute_threshold=64``, ``decoder_kv_blocks_ttl=480``)."""
    cfg: dict[str, Any] = {"num_threads": num_threads, **extra}
    if bidirectional:
        cfg["bidirectional_kv_xfer"] = True
    return {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": cfg}


def shuttle_transfer_config(*, bidirectional: bool = True, **extra: Any) -> dict[str, Any]:
    """kvshuttle's ``KVShuttleConnector`` (``extra`` goes to ``kv_connector_extra_config``)."""
    return {"kv_connector": "KVShuttleConnector", "kv_connector_module_path": "kvshuttle.integrations.vllm",
            "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": bidirectional, **extra}}


def pd_pair(model: str, prefill_config: dict[str, Any], decode_config: dict[str, Any], log_dir: Path, *,
            name: str = "", warmup_tokens: int = 64, request_timeout_s: float = 180.0,
            decode_block_size: int | None = None, prefill_tp: int = 1, decode_tp: int = 1,
            prefill_prefix_cache: bool = False, prefill_llm_kwargs: dict[str, Any] | None = None,
            llm_kwargs: dict[str, Any] | None = None) -> tuple[VllmEngine, VllmEngine]:
    """A prefill (prefix cache off, core 0) and a decode engine (prefix cache on, core 1), not started yet
    (:func:`start_all`). A NIXL engine gets a free side-channel port of its own (they all default to 5600).
    ``decode_block_size``: the decode's block size when it differs from prefill's 32. ``prefill_tp`` /
    ``decode_tp``: tensor-parallel sizes (vLLM's multiprocess executor; an engine's ranks share its core).
    ``prefill_prefix_cache``: the production setting (reverse reads then start where the local hit ends).
    ``prefill_llm_kwargs``: more ``LLM(...)`` arguments for the prefill (scheduler and cache settings);
    ``llm_kwargs``: for both (e.g. ``worker_extension_cls=kv_probe.WORKER_EXTENSION``)."""
    engines = []
    for role, config, cores, tp in (("prefill", prefill_config, (0,), prefill_tp),
                                    ("decode", decode_config, (1 % (os.cpu_count() or 1),), decode_tp)):
        port = free_port() if config.get("kv_connector") == "NixlConnector" else None
        label = f"{name}-{role}" if name else role
        engines.append(VllmEngine(EngineSpec(
            model=model, name=label, kv_transfer_config=config,
            enable_prefix_caching=role == "decode" or prefill_prefix_cache,
            block_size=(decode_block_size or 32) if role == "decode" else 32,
            side_channel_port=port, cpu_cores=cores, warmup_tokens=warmup_tokens, startup_timeout_s=420.0,
            request_timeout_s=request_timeout_s, log_path=str(log_dir / f"{label}.log"),
            llm_kwargs={**tensor_parallel(tp), **(llm_kwargs or {}),
                        **((prefill_llm_kwargs or {}) if role == "prefill" else {})}),
            start=False))
    return engines[0], engines[1]


def tensor_parallel(tp_size: int) -> dict[str, Any]:
    """``LLM(...)`` arguments for ``tp_size`` tensor-parallel ranks (none at 1)."""
    return {"tensor_parallel_size": tp_size, "distributed_executor_backend": "mp"} if tp_size > 1 else {}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (racy by nature; fine for tests on one host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_pids(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (from ``/proc``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return sorted(pids)


def pin_group(pgid: int, cores: tuple[int, ...]) -> int:
    """Pin every thread of every process in group ``pgid`` to ``cores``; returns how many threads.

    ``os.sched_setaffinity(pid)`` on Linux sets one thread's mask, so each task id in ``/proc/<pid>/task`` is
    set; threads created later inherit their creator's mask.
    """
    n = 0
    for pid in group_pids(pgid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cores)
                n += 1
            except OSError:  # the thread ended meanwhile
                pass
    return n


def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for it to empty, then SIGKILL whatever is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not group_pids(pgid):
                return
            time.sleep(0.1)


def reap(proc: subprocess.Popen[bytes], finalizer: weakref.finalize[Any, Any] | None, grace_s: float) -> None:
    """Kill ``proc``'s process group (it leads its own session), wait for it, drop its exit-time finalizer."""
    kill_group(proc.pid, grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    if finalizer is not None:
        finalizer.detach()


class VllmEngine:
    """A running engine. Use as a context manager, or call :meth:`close` in ``finally``."""

    def __init__(self, spec: EngineSpec, *, start: bool = True) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.startup_s: float | None = None  # launch to ready, seen from here (includes the warm-up)
        self.child_startup_s: float | None = None  # building the LLM, seen from the child
        self.warmup_s = 0.0
        self.pinned_threads = 0
        self._t_launch = 0.0
        if start:
            self.start()

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> VllmEngine:
        """Start the child and wait (``startup_timeout_s``) until its ``LLM`` is built and warmed up."""
        return self.launch().wait_ready()

    def launch(self) -> VllmEngine:
        """Start the child process without waiting (see :meth:`wait_ready`, :func:`start_all`)."""
        if self.proc is not None:
            raise EngineError(f"{self.spec.name}: already started")
        spec = self.spec
        env = {**os.environ, **BASE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_space_gib)}
        if spec.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
        pkg_root = str(Path(__file__).resolve().parents[3])  # .../python (for a connector module path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        env.update(spec.env)
        ours, theirs = socket.socketpair()
        log = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if spec.log_path else None
        self._t_launch = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(_CHILD), "--fd", str(theirs.fileno()), "--spec", spec.to_child(),
                 "--parent", str(os.getpid())],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL if log is None else log,
                stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            if log is not None:
                os.close(log)
        self._finalizer = weakref.finalize(self, kill_group, self.proc.pid, 2.0)
        self._conn = Connection(ours.detach())
        return self

    def wait_ready(self) -> VllmEngine:
        """Wait for the child's start-up message; pins the engine if asked. Closes the engine on failure."""
        try:
            info = self._call(None, self.spec.startup_timeout_s, what="start-up")
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - self._t_launch
        self.child_startup_s = float(info["startup_s"])
        self.warmup_s = float(info.get("warmup_s") or 0.0)
        if self.spec.cpu_cores is not None:
            self.pin(self.spec.cpu_cores)
        return self

    def pin(self, cores: tuple[int, ...]) -> int:
        """Pin every thread of the engine's processes to ``cores`` (see :func:`pin_group`)."""
        self.pinned_threads = pin_group(self.pgid, cores)
        return self.pinned_threads

    @property
    def pgid(self) -> int:
        if self.proc is None:
            raise EngineError(f"{self.spec.name}: not started")
        return self.proc.pid  # start_new_session: the child leads its own group

    def pids(self) -> list[int]:
        """The engine's live processes (the child, EngineCore, worker, ...)."""
        return group_pids(self.pgid) if self.proc is not None else []

    def close(self, grace_s: float = 5.0) -> None:
        """Kill the engine's whole process group (idempotent)."""
        if self.proc is None:
            return
        if self._conn is not None and self.proc.poll() is None:
            try:
                self._conn.send({"op": "close"})
                if self._conn.poll(min(grace_s, 2.0)):
                    self._conn.recv()
            except (OSError, EOFError):
                pass
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        reap(self.proc, self._finalizer, grace_s)
        self.proc = None

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- requests
    def generate(self, prompt_token_ids: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
                 *, logprobs: int | None = 5, ignore_eos: bool = True, timeout_s: float | None = None,
                 cache_salt: str | None = None) -> dict[str, Any]:
        """Greedy generation of ``max_tokens`` tokens for a token-id prompt.

        Returns ``token_ids``, ``kv_transfer_params`` (what vLLM put on the final output), ``ttft_s``,
        ``engine_ttft_s``, ``engine_queue_s``, ``latency_s``, ``first_logprobs`` (top ``logprobs`` of the
        first sampled token, ``{token_id: logprob}``), ``logprobs`` (the same for every token),
        ``num_prompt_tokens``, ``num_cached_tokens``, ``finish_reason``, ``request_id``. ``kv_transfer_params`` goes to
        vLLM as ``SamplingParams(extra_args={"kv_transfer_params": ...})``. ``cache_salt``: the request neither hits nor
        feeds other requests' prefix-cache blocks (an independent reference on an engine whose cache is on).
        """
        msg = {"op": "generate", "prompt_token_ids": list(prompt_token_ids), "max_tokens": max_tokens,
               "kv_transfer_params": kv_transfer_params, "logprobs": logprobs, "ignore_eos": ignore_eos,
               "cache_salt": cache_salt}
        result: dict[str, Any] = self._call(msg, timeout_s or self.spec.request_timeout_s, what="generate")
        return result

    def script(self, steps: list[dict[str, Any]], timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Several requests interleaved as a client would: ``steps`` in order, each ``{"do": "add", "id": ...,
        "prompt_token_ids": ..., "max_tokens": ..., "kv_transfer_params": ..., "cache_salt": ...}`` (queued, not
        waited for), ``{"do": "sleep", "s": ...}``, ``{"do": "abort", "id": ...}`` or ``{"do": "wait", "id": ...}``;
        then every request is waited for. Returns ``{id: generate's result}`` (``finish_reason`` "abort" for an
        aborted one)."""
        result: dict[str, dict[str, Any]] = self._call({"op": "script", "steps": steps},
                                                       timeout_s or self.spec.request_timeout_s, what="script")
        return result

    def keep_stepping(self, interval_s: float | None) -> None:
        """While idle, run a 1-token filler request every ``interval_s`` seconds (``None``: stop)."""
        self._call({"op": "keep_stepping", "interval_s": interval_s}, 30.0, what="keep_stepping")

    def kv_usage(self) -> dict[str, float | None]:
        """After one filler step: ``kv_cache_usage_perc`` (vLLM's, 1 - free/total blocks) and
        ``kvshuttle_retained_blocks`` (the connector's gauge; None without kvshuttle) and the host tier's
        ``kvshuttle_tier_blocks``, ``_bytes``, ``_demotions``, ``_reads``, ``_misses`` (None without a tier), and
        the disk tier's as ``kvshuttle_disk_tier_*``."""
        result: dict[str, float | None] = self._call({"op": "kv_usage"}, 60.0, what="kv_usage")
        return result

    def metrics(self) -> dict[str, float]:
        """vLLM's counters and gauges by name, without the ``vllm:`` prefix (e.g. ``num_preemptions``)."""
        result: dict[str, float] = self._call({"op": "metrics"}, 60.0, what="metrics")
        return result

    def rpc(self, method: str, *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """vLLM's ``collective_rpc(method, args)`` on the engine's workers: one answer per rank."""
        result: list[Any] = self._call({"op": "rpc", "method": method, "args": list(args)}, timeout_s, what=method)
        return result

    def reset_prefix_cache(self) -> bool:
        return bool(self._call({"op": "reset_prefix_cache"}, 60.0, what="reset_prefix_cache"))

    def ping(self, timeout_s: float = 30.0) -> dict[str, Any]:
        result: dict[str, Any] = self._call({"op": "ping"}, timeout_s, what="ping")
        return result

    def _call(self, msg: dict[str, Any] | None, timeout_s: float, *, what: str) -> Any:
        """Send ``msg`` (None: only wait for the start-up message) and wait for the reply."""
        if self._conn is None or self.proc is None:
            raise EngineError(f"{self.spec.name}: not running")
        try:
            if msg is not None:
                self._conn.send(msg)
            deadline = time.monotonic() + timeout_s
            while not self._conn.poll(0.5):
                if self.proc.poll() is not None:
                    raise EngineError(f"{self.spec.name}: exited with {self.proc.returncode} during {what}"
                                      f"{self._log_hint()}")
                if time.monotonic() > deadline:
                    self.close()
                    raise EngineError(f"{self.spec.name}: no answer to {what} in {timeout_s:.0f} s; engine killed"
                                      f"{self._log_hint()}")
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineError(f"{self.spec.name}: connection lost during {what}: {exc}{self._log_hint()}") from exc
        if not reply.get("ok"):
            raise EngineError(f"{self.spec.name}: {what} failed: {reply.get('error')}\n{reply.get('traceback', '')}")
        return reply.get("result")

    def _log_hint(self) -> str:
        return f" (log: {self.spec.log_path})" if self.spec.log_path else ""


class Startable(Protocol):
    """An engine started in two steps (``VllmEngine``, ``serve.ServedEngine``)."""

    def launch(self) -> Any: ...

    def wait_ready(self) -> Any: ...

    def close(self, grace_s: float = 5.0) -> None: ...


def start_all(*engines: Startable) -> None:
    """Launch every engine, then wait for each (start-ups overlap); on any failure close them all and raise."""
    try:
        for e in engines:
            e.launch()
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.close()
        raise
