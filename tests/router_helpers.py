"""Helpers for the router's tests: an event loop in a thread, a deployment of fake vLLM servers behind a real
router, a real ``redis-server`` on a free port, and the official ``openai`` client driving turns.

The fake servers are :class:`kvshuttle.router.doubles.FakeVllm` (test doubles, not vLLM).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvshuttle.router import Router, RouterConfig, parse_backend
from kvshuttle.router.doubles import FakeVllm
from kvshuttle.router.proxy import PUBLISH_KEY
from kvshuttle.trust import GRANT_FIELD, DeploymentSecret

T = TypeVar("T")
TIMEOUT_S = 60.0  # generous: the test machine may be a loaded 2-core VM


def fresh_secret() -> DeploymentSecret:
    """A fresh deployment secret (tests never depend on this user's local one)."""
    return DeploymentSecret(secrets.token_hex(32).encode(), source="test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopThread:
    """An asyncio loop on a daemon thread; ``run(coro)`` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Deployment:
    """Fake prefills and decodes, and a router in front of them (restartable, same port)."""

    loop: LoopThread
    prefills: list[FakeVllm]
    decodes: list[FakeVllm]
    config: RouterConfig
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    router: Router | None = None
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_router(self, **changes: Any) -> Router:
        if changes:
            self.config = replace(self.config, **changes)
        router = Router(self.config, **self.router_kwargs)

        async def go() -> None:
            self._runner = router.runner()
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self.port = self._runner.addresses[0][1]

        self.loop.run(go())
        self.router = router
        return router

    def stop_router(self) -> None:
        if self._runner is not None:
            self.loop.run(self._runner.cleanup())
            self._runner = None

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             timeout=TIMEOUT_S, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from the router's /metrics (0 when absent)."""
        admin = {"Authorization": f"Bearer {self.config.admin_key}"} if self.config.admin_key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + "/metrics", headers=admin),
                                    timeout=TIMEOUT_S) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    def close(self) -> None:
        self.stop_router()
        for server in self.prefills + self.decodes:
            self.loop.run(server.stop())


def deploy(loop: LoopThread, *, prefills: int = 1, decodes: int = 1, connector: str = "kvshuttle",
           router_kwargs: dict[str, Any] | None = None, backend_kwargs: dict[str, Any] | None = None,
           **config: Any) -> Deployment:
    """Fake backends and a router sharing one fresh deployment secret (``config["secret"]`` if given)."""
    secret = config.setdefault("secret", fresh_secret())
    extra = {"secret": secret, **(backend_kwargs or {})}
    p = [loop.run(FakeVllm("prefill", connector, **extra).start()) for _ in range(prefills)]
    d = [loop.run(FakeVllm("decode", connector, **extra).start()) for _ in range(decodes)]
    cfg = RouterConfig(prefill=[parse_backend(s.backend) for s in p], decode=[parse_backend(s.backend) for s in d],
                       connector=connector, **{"health_interval_s": 3600.0, **config})  # type: ignore[arg-type]
    deployment = Deployment(loop, p, d, cfg, router_kwargs or {})
    deployment.start_router()
    return deployment


@dataclass
class Conversation:
    """A chat driven with the official client: each turn adds the answer and a new user message."""

    client: openai.OpenAI
    conversation_id: str
    first: str
    messages: list[dict[str, str]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)

    def turn(self, stream: bool, text: str | None = None, **extra_body: Any) -> str:
        self.messages.append({"role": "user", "content": text or (self.first if not self.messages else "more")})
        body = {"conversation_id": self.conversation_id, **extra_body}
        if stream:
            chunks = self.client.chat.completions.create(model="fake", messages=self.messages,  # type: ignore[arg-type]
                                                         stream=True, extra_body=body, extra_headers=self.headers)
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            done = self.client.chat.completions.create(model="fake", messages=self.messages,  # type: ignore[arg-type]
                                                       extra_body=body, extra_headers=self.headers)
            answer = done.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def routing(params: dict[str, Any]) -> dict[str, Any]:
    """``kv_transfer_params`` without what the router adds per request (the retention grant, a publish key)."""
    return {k: v for k, v in params.items() if k not in (GRANT_FIELD, PUBLISH_KEY)}


def prefill_handles(server: FakeVllm) -> list[dict[str, Any]]:
    """The kv_transfer_params each completion request to ``server`` carried, in order (grant left out: the
    doubles count valid grants, ``stats.granted``)."""
    return [routing(r["body"].get("kv_transfer_params") or {}) for r in server.requests]


def post_raw(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST bytes as they are; (status, body) whatever the status."""
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def raw_connection(port: int, head: bytes, body: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    """A client socket to the router that has sent ``head`` (request line and headers, blank line included)
    and ``body``, and nothing more; ``rcvbuf`` shrinks its receive buffer (a client that reads slowly)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT_S)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one HTTP response (Content-Length or read to the end); the socket's timeout applies."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the connection closed before a whole response head: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), None)
    while length is None or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body


def head(path: str, length: int | None, **headers: str) -> bytes:
    """A POST request head for the router (``Content-Length`` when ``length`` is given)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Terminate a router process started by a test, then kill it if it does not exit."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def wait_until(condition: Callable[[], bool], timeout: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# -- a real redis-server ---------------------------------------------------------------------------------------
class RedisServer:
    def __init__(self, tmp: Path, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (CI installs it: apt-get install redis-server)")
        self.binary, self.tmp, self.port, self.password = binary, tmp, free_port(), password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp), *auth],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(self._answers, 30.0):
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}")
        return self

    def _answers(self) -> bool:
        hello = (f"AUTH {self.password}\r\n" if self.password else "").encode() + b"PING\r\n"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(hello)
                got = b""
                while b"PONG" not in got and len(got) < 256:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    got += chunk
                return b"+PONG" in got
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
