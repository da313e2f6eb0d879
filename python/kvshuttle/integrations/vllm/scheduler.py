"""The scheduler side (vLLM's EngineCore process): decide reads, issue handles for finished requests.

It never moves a byte and never blocks the engine loop: it decides with the policy (pure, microseconds),
tells the worker what to read or keep through the step's metadata, and returns ``kv_transfer_params`` for
finished requests. Where a block goes from "request finished" to "freed":

1. ``request_finished`` (here): a request that finished normally and that a reader may want (a prefill's
   prompt for its decode: ``do_remote_decode``; a decode's prompt + answer for the next turn's prefill, with
   ``bidirectional_kv_xfer``) keeps its blocks (vLLM frees them only when the worker reports the request in
   ``finished_sending``) and gets a handle: an unguessable id, the blocks, their digests, the expiry, the
   worker's side-channel address. A ``RetainJob`` carries it to the worker in the next step's metadata.
2. The worker's retention ledger holds the blocks until the handle ends: its TTL passes
   (``decoder_kv_blocks_ttl`` / ``kv_lease_duration``; swept every step), it is released, the retention budget
   evicts it (least recently used first, never one being read), or a use-once read completes. Reads in flight
   pin it: an end takes effect when the last read finishes.
3. The ledger's ``on_release`` names the request; the worker reports it in ``finished_sending``; vLLM's
   scheduler frees the blocks (reference-counted: blocks shared with a later turn stay).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from ...core.blocks import blocks_for_tokens
from ...errors import KVShuttleError
from ...policy import Decision, KVHandle, block_digests, decide, parse_handle
from ...policy.kv_handle import PREFIX
from ...transfer.board import PUBLISH_KEY, check_publish_key
from .config import ShuttleConfig
from .metadata import LoadJob, Publication, RetainJob, ShuttleHandshake, ShuttleMetadata
from .requests import block_table, finished_normally
from .stats import ShuttleStats

log = logging.getLogger("vllm.kvshuttle")  # under vLLM's logger: its handler shows INFO lines
CONSUMED = PREFIX + "consumed"  # set in a request's params once its load is scheduled: never load twice


class ShuttleScheduler:
    def __init__(self, config: ShuttleConfig, engine_id: str, block_size: int) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.policy = config.policy()
        self.address: ShuttleHandshake | None = None  # the worker's side channel, once it reported it
        self._decisions: dict[str, tuple[int, Decision]] = {}  # request -> (local hit, decision) awaiting alloc
        self._loads: list[LoadJob] = []
        self._retains: list[RetainJob] = []
        self._publications: list[Publication] = []
        self._held: set[str] = set()  # requests whose blocks wait for the worker's finished_sending
        self._reads: dict[str, tuple[int, frozenset[int]]] = {}  # request -> (tokens read, target blocks)
        self._warned: set[str] = set()
        self.counts: dict[str, int] = {}

    # -- admission ------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to read (asynchronously) beyond the local hit; (0, False) to compute them. No side effects
        on vLLM's state: it may ask again for the same request."""
        params = request.kv_transfer_params
        if not params or params.get(CONSUMED) or (PREFIX + "version") not in params:
            if params and params.get("remote_block_ids") and (PREFIX + "version") not in params:
                self._warn_once("foreign", "kvshuttle: kv_transfer_params from another connector (no kvshuttle "
                                           "handle): they cannot be verified, recomputing")
            return 0, False
        if params.get("do_remote_decode") and not self.config.bidirectional:
            self._warn_once("bidir", "kvshuttle: a decode handle reached this engine, but bidirectional_kv_xfer is "
                                     "off here: recomputing (enable it on prefill and decode)")
            return 0, False
        handle = parse_handle(params)
        if not isinstance(handle, KVHandle):
            self._record(request.request_id, handle)
            return 0, False
        decision = decide(request.prompt_token_ids, local_hit_tokens=num_computed_tokens, handle=handle,
                          now_wall=time.time(), config=self.policy)
        tokens = decision.fetch_token_range
        if decision.fetch and (tokens.start != num_computed_tokens or tokens.start % self.block_size):
            self._count("misaligned")
            log.info("kvshuttle: request %s recomputes, because the verified range starts at token %d, not at the "
                     "local hit's end on a block boundary", request.request_id, tokens.start)
            return 0, False
        if not decision.fetch:
            self._record(request.request_id, decision)
            return 0, False
        self._decisions[request.request_id] = (num_computed_tokens, decision)
        return decision.fetch_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        held = self._decisions.pop(request.request_id, None)
        if held is None:
            return
        local_hit, decision = held
        table = block_table(blocks)
        first = local_hit // self.block_size
        local = tuple(table[first:first + blocks_for_tokens(decision.fetch_tokens, self.block_size)])
        request.kv_transfer_params[CONSUMED] = True  # the same dict survives preemption: never load twice
        self._reads[request.request_id] = (decision.fetch_tokens, frozenset(local))
        self._loads.append(LoadJob(request.request_id, dict(request.kv_transfer_params), decision, local,
                                   len(request.prompt_token_ids)))
        self._record(request.request_id, decision)

    def build_connector_meta(self) -> ShuttleMetadata:
        meta = ShuttleMetadata(self._loads, self._retains, self._publications)
        self._loads, self._retains, self._publications = [], [], []
        return meta

    # -- finished requests ----------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._decisions.pop(request.request_id, None)
        read, _ = self._reads.pop(request.request_id, (0, frozenset()))
        params = request.kv_transfer_params
        keep, out = self._retain(request, block_ids, params, read)
        key = params.get(PUBLISH_KEY) if isinstance(params, dict) else None
        if key is not None:  # a streaming router takes the params from the worker's board (board.py)
            try:
                self._publications.append(Publication(request.request_id, check_publish_key(key), out))
            except KVShuttleError as exc:
                self._warn_once("publish_key", f"kvshuttle: not publishing request {request.request_id}: {exc}")
        return keep, out

    def _retain(self, request: Any, block_ids: Any, params: Any, read: int) -> tuple[bool, dict[str, Any] | None]:
        if not params or not finished_normally(request):
            return False, None
        prefill = bool(params.get("do_remote_decode"))  # this engine prefilled for a decode
        if not prefill and not self.config.bidirectional:
            return False, None
        if self.address is None:
            self._warn_once("address", "kvshuttle: the worker has not reported its side channel; nothing retained")
            return False, None
        tokens = int(request.num_computed_tokens)
        table = block_table(block_ids)[:blocks_for_tokens(tokens, self.block_size)]
        if tokens <= 0 or len(table) != blocks_for_tokens(tokens, self.block_size):
            return False, None
        ttl = self.config.prefill_ttl_s if prefill else self.config.decode_ttl_s
        now = time.time()
        digests = tuple(block_digests(list(request.all_token_ids[:tokens]), self.block_size,
                                      extra_key=self.policy.extra_key))
        handle = KVHandle(self.engine_id, request.request_id, self.address.host, self.address.port, tuple(table),
                          tokens, now + ttl, 1, secrets.token_urlsafe(18), 0, self.block_size, digests, now, ttl)
        once = prefill or self.config.reads == "use_once"  # a prompt is read by its one decode
        self._retains.append(RetainJob(request.request_id, handle.handle_id, handle.block_ids, digests, tokens,
                                       self.block_size, ttl, once))
        self._held.add(request.request_id)
        self._count("retained")
        out = handle.to_kv_transfer_params()
        # vLLM's proxy protocol: a prefill's params send its decode to read (do_remote_prefill); a decode's
        # send the next turn's prefill to read back (do_remote_decode).
        out.update(do_remote_prefill=prefill, do_remote_decode=not prefill, transfer_mode="pull")
        out[PREFIX + "read_tokens"] = read  # what this request itself read from its peer (proof of reuse)
        return True, out

    def update_connector_output(self, finished_sending: set[str] | None, invalid_block_ids: set[int] | None) -> None:
        for request_id in finished_sending or ():
            self._held.discard(request_id)
        if invalid_block_ids:  # a read that failed: vLLM recomputes those blocks, so nothing was reused
            for request_id, (_, blocks) in list(self._reads.items()):
                if blocks & invalid_block_ids:
                    self._reads[request_id] = (0, blocks)
                    self._count("load_failed")

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def take_stats(self) -> ShuttleStats:
        """Decisions counted since the last call (vLLM merges them with the worker's)."""
        stats, self.counts = ShuttleStats.counting(self.counts, "decision"), {}
        return stats

    def _record(self, request_id: str, decision: Decision) -> None:
        self._count(decision.reason.value)
        if decision.fetch:
            log.info("kvshuttle: request %s reads %d tokens (%s)", request_id, decision.fetch_tokens, decision.message)
        elif decision.reason.value != "no_handle":
            log.info("kvshuttle: request %s recomputes, because %s", request_id, decision.message)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _warn_once(self, key: str, message: str) -> None:
        self._count(key)
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
