"""Test doubles: small aiohttp servers that answer like vLLM's OpenAI server with a P/D connector.

Not vLLM: no model, no KV. :class:`FakeVllm` answers ``/v1/completions`` and ``/v1/chat/completions``
(streamed as SSE chunks and not), ``/health`` and ``/_stats``, and plays one role:

* ``prefill``: returns one token and a prefill handle in ``kv_transfer_params``; it checks what it was sent:
  a handle whose conversation marker (a digest of the conversation's first message, carried in
  ``remote_request_id``) differs from its prompt's is counted ``cross`` (a handle given to the wrong
  conversation or tenant), a later turn without a handle ``lost``;
* ``decode``: streams ``tokens`` tokens and returns a decode handle: kvshuttle's wire format
  (:class:`~kvshuttle.policy.KVHandle`, signed with ``secret``, unless ``connector="nixl"``) on non-streaming
  answers, on a stream's last chunk when ``stream_params`` (vLLM 0.33 does that), and, when the request
  carries ``kvshuttle_publish_key``, on a real kvshuttle side channel (``serve_side_channel``) whose handle
  board the router takes it from, as kvshuttle's connector does.

Both roles count the requests that carried a valid retention grant (``kvshuttle_grant`` under ``secret``).
``behaviour`` switches failure modes at run time: ``fail`` (HTTP 500), ``die_mid_stream`` (the connection is
dropped after the first chunk), ``malformed`` (handles the router must refuse), ``forged`` (a signed handle
edited afterwards), ``unsigned`` (no MAC), ``hang`` (never answers), ``flood`` (a stream that never ends,
64 KiB events as fast as they are taken), ``echo_400`` (a 400 whose message echoes the request, as vLLM's
validation errors may), ``unhealthy`` (``/health`` answers 503), ``linger`` (a stream stays open 3 s after its end
marker); ``barrier`` holds requests until that many have
arrived. With a ``codec`` (:class:`~kvshuttle.router.token_exact.ChatCodec`, a real tokenizer) chat requests are
tokenized as vLLM does (``kv_transfer_params.prompt_token_ids`` used instead of rendering, the prompt ids of each
request kept in ``prompt_ids``), and ``return_token_ids`` answers with ids: the decode's answer is spelled one
character per token (a split no re-tokenization gives back) and ends with the stop token.
Used by the router's tests and ``kvshuttle bench router``
(``python -m kvshuttle.router.doubles`` serves a prefill and a decode and prints their addresses as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from ..policy.kv_handle import KVHandle
from ..retention.terms import DEFAULT_READ_MODE, DEFAULT_TTL_S, ReadMode
from ..trust import GRANT_FIELD, DeploymentSecret, grant_valid

BLOCK_SIZE = 16
_ARRIVALS = itertools.count()  # one order over every double of the process (which backend got a turn first)
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def marker(body: dict[str, Any]) -> str:
    """The conversation's identity as the doubles see it: a digest of its first message (or prompt start)."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        first = str(messages[0].get("content"))
    else:
        first = str(body.get("prompt", ""))[:64]
    return hashlib.blake2b(first.encode(), digest_size=6).hexdigest()


def turn_number(body: dict[str, Any]) -> int:
    """Chat turn k sends 2k - 1 messages (user, assistant, ..., user); 0 when unknown (completions)."""
    messages = body.get("messages")
    return (len(messages) + 1) // 2 if isinstance(messages, list) else 0


@dataclass
class Stats:
    requests: int = 0
    handles_in: int = 0  # prefill: requests that came with a decode handle
    matched: int = 0  # ... whose handle was issued for this request's conversation
    cross: int = 0  # ... whose handle belongs to another conversation (must stay 0)
    lost: int = 0  # prefill: later turns (chat) that came without a handle
    issued: int = 0  # decode: handles returned or published
    published: int = 0
    granted: int = 0  # completion requests whose kv_transfer_params carried a valid retention grant
    ungranted: int = 0  # ... that carried none, or an invalid one
    flood_ended: int = 0  # "flood" streams that ended (their reader went away)
    released: list[str] = field(default_factory=list)
    demoted: list[str] = field(default_factory=list)  # handle ids a demote_retention named
    max_active: int = 0  # most completion requests in progress at once
    cancelled: int = 0  # completion requests whose client (the router) went away before the answer was done


class FakeVllm:
    """One fake vLLM server; see the module docstring. ``start()`` binds a free port."""

    def __init__(self, role: str, connector: str = "kvshuttle", tokens: int = 3, delay_s: float = 0.0,
                 side_channel: bool = True, secret: DeploymentSecret | None = None,
                 stream_params: bool = False, codec: Any = None) -> None:
        self.role, self.connector, self.tokens, self.delay_s = role, connector, tokens, delay_s
        self.secret = secret if secret is not None else DeploymentSecret.resolve()  # as a router resolves it
        self.stream_params = stream_params  # vLLM 0.33: a stream's last chunk carries kv_transfer_params
        self.behaviour = "ok"
        self.finish_reason = "stop"  # of every answer ("tool_calls": the client comes back with tool results)
        self.demotion = "ok"  # the side channel's answer to demote_retention: ok, refuse (NoTierError), error
        self.codec = codec
        self.prompt_ids: list[list[int]] = []  # with a codec: each chat request's prompt, as the engine saw it
        self.read_tokens: int | None = None  # prefill: what it reports reading back for a handle (None: 3 blocks)
        self.content_read_tokens = 0  # prefill: what it reports reading with no handle (found in a content index)
        self.read_mode: ReadMode = DEFAULT_READ_MODE  # decode: the read mode its handles name (kvshuttle_reads)
        self.prewarms: list[dict[str, Any]] = []  # bodies of pre-warm requests (add_generation_prompt false)
        self.prewarm_gate: asyncio.Event | None = None  # set: pre-warms wait for it
        self.barrier = 0  # > 0: hold each request until this many have arrived (makes overlaps certain)
        self._arrived = 0
        self._active = 0
        self.stats = Stats()
        self.requests: list[dict[str, Any]] = []  # {"path", "body", "headers", "order"} per completion request
        self.issued_params: list[dict[str, Any] | None] = []  # decode: the params each answer returned
        self.keep_requests = True
        self.name = f"{role}-{uuid.uuid4().hex[:6]}"
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.board: Any = None
        self._side: Any = None
        self._zmq: Any = None
        self.kv_host, self.kv_port = "127.0.0.1", 1
        if role == "decode" and connector == "kvshuttle" and side_channel:
            self._serve_side_channel()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_address(self) -> str | None:
        return f"{self.kv_host}:{self.kv_port}" if self._side is not None else None

    @property
    def backend(self) -> str:
        """The router's ``--decode`` / ``--prefill`` argument for this server."""
        return self.url + (f",kv={self.kv_address}" if self.kv_address else "")

    def _serve_side_channel(self) -> None:
        import zmq

        from ..transfer.board import HandleBoard, serve_take
        from ..transfer.side_channel import SideChannelServer

        self.board = HandleBoard(ttl_s=60.0)

        def answer(_: bytes, message: dict[str, Any]) -> dict[str, Any] | None:
            op = message.get("op")
            if op == "take_published":
                return serve_take(self.board, message)
            if op == "release_retention":
                self.stats.released.append(str(message.get("handle_id")))
                return {"op": "released", "released": True}
            if op == "demote_retention":
                self.stats.demoted.append(str(message.get("handle_id")))
                if self.demotion == "refuse":
                    return {"op": "refused", "reason": "NoTierError", "message": "this ledger has no tier"}
                if self.demotion == "error":
                    return {"op": "error", "kind": "internal", "message": "the double broke"}
                return {"op": "demoted", "demoted": True}
            if op == "ping":
                return {"op": "pong", "jobs": 0}
            return {"op": "error", "kind": "protocol", "message": f"the double does not serve {op!r}"}

        # A context of its own: each side-channel server runs its context's one ZAP (authentication) handler.
        self._zmq = zmq.Context()
        self._side = SideChannelServer(self._zmq, "127.0.0.1", 0, answer, secret=self.secret)
        self.kv_port = self._side.port

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self, port: int = 0) -> FakeVllm:
        app = web.Application(client_max_size=64 << 20)  # the router bounds what clients send (4 MiB by default)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/_stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._side is not None:
            self._side.close()
            self._side = None
            self._zmq.destroy(linger=0)

    # -- endpoints ------------------------------------------------------------------------------------------
    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=503 if self.behaviour == "unhealthy" else 200)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _stats(self, _: web.Request) -> web.Response:
        s = self.stats
        return web.json_response({"requests": s.requests, "handles_in": s.handles_in, "matched": s.matched,
                                  "cross": s.cross, "lost": s.lost, "issued": s.issued, "published": s.published,
                                  "released": len(s.released)})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self._active += 1
        self.stats.max_active = max(self.stats.max_active, self._active)
        try:
            return await self._completion(request)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        finally:
            self._active -= 1

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.stats.requests += 1
        sent = body.get("kv_transfer_params")
        if grant_valid(self.secret, sent.get(GRANT_FIELD) if isinstance(sent, dict) else None):
            self.stats.granted += 1
        else:
            self.stats.ungranted += 1
        if body.get("add_generation_prompt") is False:  # a router's pre-warm: one token, nothing to hand over
            self.prewarms.append(body)
            if self.prewarm_gate is not None:
                await self.prewarm_gate.wait()
            return self._answer(request, body, "x", None)
        if self.keep_requests:
            self.requests.append({"path": request.path, "body": body, "headers": CIMultiDict(request.headers),
                                  "order": next(_ARRIVALS)})
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.behaviour == "fail":
            return web.json_response({"error": {"message": "the double fails on purpose"}}, status=500)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.barrier:
            self._arrived += 1
            for _ in range(3000):  # 30 s at most
                if self._arrived >= self.barrier:
                    break
                await asyncio.sleep(0.01)
        conv = marker(body)
        params = body.get("kv_transfer_params") or {}
        prompt = self._prompt(request, body, params)
        if self.behaviour == "echo_400":  # vLLM's validation errors may quote the whole request
            return web.json_response({"object": "error", "message": f"invalid request: {body!r}",
                                      "type": "BadRequestError", "code": 400}, status=400)
        if self.role == "prefill":
            self._check_handle(body, params, conv)
            prefilled = self._prefill_params(conv, request)
            if self.connector == "kvshuttle":  # as kvshuttle's connector reports what it read back
                read = 3 * BLOCK_SIZE if self.read_tokens is None else self.read_tokens
                found = self.content_read_tokens
                prefilled["kvshuttle_read_tokens"] = read if params.get("remote_block_ids") else found
            return self._answer(request, body, "x", prefilled)
        out = self._decode_params(conv, request)
        if body.get("stream"):
            return await self._stream(request, body, out, params.get("kvshuttle_publish_key"), prompt)
        return self._answer(request, body, self._text(), out, prompt)

    def _check_handle(self, body: dict[str, Any], params: dict[str, Any], conv: str) -> None:
        rid = params.get("remote_request_id")
        if params.get("remote_block_ids"):
            self.stats.handles_in += 1
            if isinstance(rid, str) and rid.split("-", 1)[0] == conv:
                self.stats.matched += 1
            else:
                self.stats.cross += 1
        elif turn_number(body) > 1:
            self.stats.lost += 1

    def _prefill_params(self, conv: str, request: web.Request) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 1,
                "remote_request_id": f"{conv}-{request.headers.get('X-Request-Id', '')}"}

    def _decode_params(self, conv: str, request: web.Request) -> dict[str, Any] | None:
        self.stats.issued += 1
        rid = f"{conv}-{request.headers.get('X-Request-Id', uuid.uuid4().hex)}"
        if self.behaviour == "malformed":
            return {"remote_request_id": rid, "remote_block_ids": "not a list", "kvshuttle_version": 1,
                    "remote_host": "127.0.0.1"}
        if self.connector == "nixl":
            return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": self.name,
                    "remote_block_ids": [4, 5, 6], "remote_host": "127.0.0.1", "remote_port": 5600,
                    "remote_request_id": rid, "tp_size": 1}
        now = time.time()
        handle = KVHandle(self.name, rid, self.kv_host, self.kv_port, (4, 5, 6), 3 * BLOCK_SIZE,
                          now + DEFAULT_TTL_S, 1, secrets.token_urlsafe(12), 0, BLOCK_SIZE, (b"\x01" * 16,) * 3,
                          now, DEFAULT_TTL_S, read_mode=self.read_mode)
        params = {**handle.to_kv_transfer_params(None if self.behaviour == "unsigned" else self.secret),
                  "do_remote_decode": True, "do_remote_prefill": False}
        if self.behaviour == "forged":  # a valid MAC over other blocks: an edit the router must catch
            params["remote_block_ids"] = [7, 8, 9]
        if self.keep_requests:
            self.issued_params.append(params)
        return params

    def _prompt(self, request: web.Request, body: dict[str, Any], params: dict[str, Any]) -> list[int] | None:
        """A chat prompt's ids as vLLM's chat path makes them (with a codec): the forwarded ones, else rendered."""
        if self.codec is None or not request.path.endswith("/chat/completions"):
            return None
        ids = params.pop("prompt_token_ids", None)
        if ids is None:
            ids = self.codec.encode(self.codec.render(body["messages"], True))
        self.prompt_ids.append(list(ids))
        return list(ids)

    def _ids(self, text: str, last: bool) -> list[int]:
        """An answer piece's ids: one per character (a split re-tokenizing never gives), the stop token last."""
        ids = [i for ch in text for i in self.codec.encode(ch)]
        return ids + (self.codec.encode("</s>") if last else [])

    def _text(self) -> str:
        return "".join(f" tok{i}" for i in range(self.tokens))

    def _answer(self, request: web.Request, body: dict[str, Any], text: str,
                params: dict[str, Any] | None, prompt: list[int] | None = None) -> web.Response:
        chat = request.path.endswith("/chat/completions")
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "logprobs": None, "finish_reason": self.finish_reason} if chat else
                                  {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason})
        answer = {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion" if chat else "text_completion",
                  "created": int(time.time()), "model": body.get("model", "fake"), "choices": [choice],
                  "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
                  "kv_transfer_params": params}
        if prompt is not None and body.get("return_token_ids"):
            answer["prompt_token_ids"], choice["token_ids"] = prompt, self._ids(text, True)
        return web.Response(body=_dumps(answer), content_type="application/json")

    async def _stream(self, request: web.Request, body: dict[str, Any], params: dict[str, Any] | None,
                      key: Any, prompt: list[int] | None = None) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        ident, created, model = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time()), body.get("model", "fake")
        if self.behaviour == "flood":
            await self._flood(out)
            return out
        for i in range(self.tokens):
            last = i == self.tokens - 1
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None,
                                       "finish_reason": self.finish_reason if last else None} if chat else
                                      {"index": 0, "text": f" tok{i}", "logprobs": None,
                                       "finish_reason": self.finish_reason if last else None})
            chunk = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model, "choices": [choice]}
            if last and self.stream_params:
                chunk["kv_transfer_params"] = params
            if prompt is not None and body.get("return_token_ids"):
                choice["token_ids"] = self._ids(f" tok{i}", last)
                if i == 0:
                    chunk["prompt_token_ids"] = prompt
            await out.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
            if self.behaviour == "die_mid_stream":
                assert request.transport is not None
                request.transport.abort()  # the process "died": no more bytes, no publication
                return out
        # vLLM 0.32 sends no kv_transfer_params on a stream; kvshuttle's connector publishes them instead.
        if isinstance(key, str) and self.board is not None:
            self.board.put(key, params)
            self.stats.published += 1
        await out.write(b"data: [DONE]\n\n")
        if self.behaviour == "linger":  # the end marker, then the stream stays open a while
            await asyncio.sleep(3.0)
        await out.write_eof()
        return out

    async def _flood(self, out: web.StreamResponse) -> None:
        """Events as fast as the reader takes them, until it goes away (1 GiB at most)."""
        event = b"data: " + _dumps({"choices": [{"index": 0, "delta": {"content": "x" * (64 << 10)}}]}).encode()
        try:
            for _ in range(1 << 14):
                await out.write(event + b"\n\n")
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self.stats.flood_ended += 1


async def _serve(args: argparse.Namespace) -> None:
    prefill = await FakeVllm("prefill", args.connector, delay_s=args.delay).start()
    decode = await FakeVllm("decode", args.connector, tokens=args.tokens, delay_s=args.delay).start()
    for server in (prefill, decode):
        server.keep_requests = False
    print(json.dumps({"prefill": prefill.backend, "decode": decode.backend}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await prefill.stop()
        await decode.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="serve a fake vLLM prefill and decode (router test doubles)")
    parser.add_argument("--connector", choices=("kvshuttle", "nixl"), default="kvshuttle")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
