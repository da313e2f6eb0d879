"""One greedy tenant against `kvshuttle router` run as a process (issue 31, item 5): tenant A floods 40 concurrent
3.8 MiB bodies of ``{}`` messages while tenant B streams small turns with the official client. Measures B's turn
latency (quiet, then under the flood), the router's resident memory (``VmRSS`` from ``/proc``), whether a
healthy backend was marked down, and how long SIGTERM takes to stop the router mid-flood.

The fake vLLM servers (:mod:`kvshuttle.router.doubles`) and tenant A's flood (``--flood PORT``) run in processes
of their own too, so the test process only drives B's client (no GIL shared with the flood's threads).
``python tests/router_flood.py`` prints the numbers as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEYS = {"sk-tenant-a": "tenant-a", "sk-tenant-b": "tenant-b"}
FLOOD_CLIENTS = 40
FLOOD_BYTES = int(3.8 * (1 << 20))
B_TURNS = 30
STARTUP_S = 60.0


def flood_body(size: int = FLOOD_BYTES, shape: str = "objects") -> bytes:
    """A chat body of about ``size`` bytes whose messages are all ``{}`` (the densest JSON objects there are), or
    (``shape="text"``) one message of plain text, which the router serves within the tenant's bounds."""
    if shape == "text":
        return json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x" * (size - 80)}],
                           "max_tokens": 1}).encode()
    count = (size - 64) // 3
    return b'{"model":"fake","messages":[' + b",".join([b"{}"] * count) + b'],"max_tokens":1}'


def rss_kib(pid: int) -> int:
    """The process's resident memory (VmRSS), KiB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _request(port: int, body: bytes, key: str, timeout: float) -> int:
    """POST ``body`` on a fresh connection; the status, or 0 when the connection failed or timed out."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            with contextlib.suppress(OSError):  # refused before the whole body went out: the answer may still come
                sock.sendall(head + body)
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            parts = data.split(b" ", 2)
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    except OSError:
        return 0


@dataclass
class Flood:
    """``clients`` threads sending tenant A's body over and over until :meth:`stop`: each keeps one request in
    flight and, refused, waits ``backoff_s`` as a client honouring ``Retry-After: 1`` does (0: it never waits;
    status 0 is a refusal whose answer the reset of the unread body lost)."""

    port: int
    backoff_s: float = 1.0
    clients: int = FLOOD_CLIENTS
    body: bytes = field(default_factory=flood_body)
    statuses: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Flood:
        for i in range(self.clients):
            thread = threading.Thread(target=self._run, name=f"flood-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            status = _request(self.port, self.body, "sk-tenant-a", 30.0)
            with self._lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1
            if status != 200 and self.backoff_s:
                self._stop.wait(self.backoff_s)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


@contextmanager
def flood_process(port: int, backoff_s: float = 1.0) -> Iterator[dict[str, int]]:
    """Tenant A's :class:`Flood` in a process of its own; the statuses it got fill the yielded dict at the end."""
    proc = subprocess.Popen([sys.executable, __file__, "--flood", str(port), str(backoff_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    statuses: dict[int, int] = {}
    try:
        yield statuses
    finally:
        try:
            out, _ = proc.communicate("", timeout=90)  # the flood stops when its stdin closes
            statuses.update({int(k): v for k, v in json.loads(out or "{}").items()})
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait(30)


def _flood_main(port: int, backoff_s: float) -> None:
    flood = Flood(port, backoff_s, body=flood_body(shape=os.environ.get("FLOOD_SHAPE", "objects"))).start()
    sys.stdin.read()  # until the parent closes it
    flood.stop()
    print(json.dumps(flood.statuses), flush=True)


@dataclass
class RouterProcess:
    proc: subprocess.Popen[str]
    url: str
    backends: subprocess.Popen[str]
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def rss_mib(self) -> float:
        return rss_kib(self.proc.pid) / 1024

    def metrics(self) -> str:
        req = urllib.request.Request(self.url + "/metrics", headers={"Authorization": "Bearer sk-admin"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return str(resp.read().decode())

    def sigterm_seconds(self, limit: float = 60.0) -> float:
        """Seconds from SIGTERM to exit (``limit`` when it had to be killed)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return limit
        return time.monotonic() - started


@contextmanager
def router_process(tmp: Path, extra: list[str] | None = None) -> Iterator[RouterProcess]:
    """Fake backends (one process) and ``kvshuttle router`` (another) sharing a fresh deployment secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
    env["KVSHUTTLE_SECRET"] = secrets.token_hex(32)
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    admin = tmp / "admin-key"
    admin.write_text("sk-admin\n")
    backends = subprocess.Popen([sys.executable, "-m", "kvshuttle.router.doubles", "--tokens", "8"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    log = tmp / "router.log"
    proc = None
    try:
        assert backends.stdout is not None
        addresses = json.loads(backends.stdout.readline())
        admin_args = ["--admin-key-file", str(admin)] if _has_flag("--admin-key-file") else []
        with log.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", addresses["prefill"],
                                     "--decode", addresses["decode"], "--port", "0", "--api-keys", str(keys),
                                     "--log-level", "WARNING", *admin_args, *(extra or [])],
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the router did not start: {log.read_text()[-2000:]}")
        yield RouterProcess(proc, line.split()[-1], backends, log)
    finally:
        for p in (proc, backends):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)


def _has_flag(flag: str) -> bool:
    import argparse

    from kvshuttle.router import main as router_main

    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    return any(flag in action.option_strings for action in parser._actions)


def b_turns(url: str, turns: int, conversation: str, deadline_s: float = 60.0) -> list[float]:
    """Tenant B's streamed turns, each timed (seconds); a failed or late turn counts as ``deadline_s``."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-tenant-b", max_retries=0, timeout=deadline_s)
    messages: list[dict[str, str]] = []
    times = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"small turn {i}"})
        started = time.perf_counter()
        try:
            chunks = client.chat.completions.create(model="fake", messages=messages, stream=True,  # type: ignore[arg-type]
                                                    extra_body={"conversation_id": conversation})
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            times.append(time.perf_counter() - started)
        except openai.OpenAIError:
            answer = ""
            times.append(deadline_s)
        messages.append({"role": "assistant", "content": answer})
    return times


def down_marks(log: Path) -> int:
    return sum("backend" in line and " is down" in line for line in log.read_text().splitlines())


def measure(tmp: Path, extra: list[str] | None = None, turns: int = B_TURNS,
            deadline_s: float = 60.0, backoff_s: float = 1.0) -> dict[str, Any]:
    """Quiet B turns, then B turns under A's flood, RSS before and at most, SIGTERM mid-flood."""
    with router_process(tmp, extra) as router:
        b_turns(router.url, 3, "warm-up")
        quiet = b_turns(router.url, turns, "quiet")
        rss_quiet = router.rss_mib()
        with flood_process(router.port, backoff_s) as statuses:
            return _under_flood(router, turns, deadline_s, quiet, rss_quiet, statuses)


def _under_flood(router: RouterProcess, turns: int, deadline_s: float, quiet: list[float], rss_quiet: float,
                 statuses: dict[int, int]) -> dict[str, Any]:
    """B's turns while A floods, sampling the router's RSS; then SIGTERM (``statuses`` fills once A stops)."""
    peak = [rss_quiet]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak.append(router.rss_mib())
            sampling.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(2.0)  # the flood is in full swing before B starts
    loud = b_turns(router.url, turns, "loud", deadline_s)
    down = down_marks(router.log)
    sigterm = router.sigterm_seconds()
    sampling.set()
    sampler.join(10)
    return {"quiet_median_s": statistics.median(quiet), "quiet_max_s": max(quiet),
            "flood_median_s": statistics.median(loud), "flood_max_s": max(loud),
            "flood_failed": sum(t >= deadline_s for t in loud), "rss_quiet_mib": round(rss_quiet, 1),
            "rss_peak_mib": round(max(peak), 1), "backend_down_marks": down,
            "sigterm_s": round(sigterm, 2), "flood_statuses": statuses}


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:2] == ["--flood"]:
        _flood_main(int(sys.argv[2]), float(sys.argv[3]))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        backoff = float(os.environ.get("FLOOD_BACKOFF_S", "1.0"))
        print(json.dumps(measure(Path(tmp), sys.argv[1:], turns=10, deadline_s=20.0, backoff_s=backoff), indent=1))
