"""The scheduler side (vLLM's EngineCore process): decide reads, issue handles for finished requests.

It never moves a byte and never blocks the engine loop: it decides with the policy (pure, microseconds),
tells the worker what to read or keep through the step's metadata, and returns ``kv_transfer_params`` for
finished requests. Where a block goes from "request finished" to "freed":

1. ``request_finished`` (here): a request that finished normally and that a reader may want (a prefill's
   prompt for its decode: ``do_remote_decode``; a decode's prompt + answer for the next turn's prefill, with
   ``bidirectional_kv_xfer``) keeps its blocks (vLLM frees them only when the worker reports the request in
   ``finished_sending``) and gets a handle: an unguessable id, the blocks, their digests, the expiry, the
   worker's side-channel address, signed with the deployment secret (``kvshuttle_mac``). A ``RetainJob``
   carries it to the worker in the next step's metadata. With ``kvshuttle_retain: "granted"`` (the default)
   only requests whose params carry a router's valid ``kvshuttle_grant`` are kept: a client talking to vLLM
   directly cannot make it hold memory.
2. The worker's retention ledger holds the blocks until the handle ends: its TTL passes
   (``decoder_kv_blocks_ttl`` / ``kv_lease_duration``; swept every step), it is released, the retention budget
   evicts it (least recently used first, never one being read), or a use-once read completes. Reads in flight
   pin it: an end takes effect when the last read finishes.
3. The ledger's ``on_release`` names the request; the worker reports it in ``finished_sending``; vLLM's
   scheduler frees the blocks (reference-counted: blocks shared with a later turn stay).

Handles arriving in a request's params are untrusted: each is authenticated (its MAC under the deployment
secret) before anything else; a forged or edited one recomputes and connects nowhere.

Per-request state lives only while vLLM holds the request: ``_decisions`` and ``_reads`` until
``request_finished``, ``_held`` until the worker reports the blocks free (``finished_sending``), ``_awaiting``
until it reports the load (``finished_recving``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import replace
from typing import Any

from ...core.blocks import blocks_for_tokens
from ...errors import KVShuttleError
from ...policy import Decision, KVHandle, PolicyConfig, block_digests, decide, parse_handle, salted_key
from ...policy.decision import Reason
from ...policy.kv_handle import PREFIX
from ...transfer.board import PUBLISH_KEY, check_publish_key
from ...trust import GRANT_FIELD, DeploymentSecret, GrantBook
from .config import ShuttleConfig
from .content_lookups import PENDING, ContentLookups
from .metadata import LoadJob, Publication, RetainJob, ShuttleHandshake, ShuttleMetadata
from .requests import block_table, finished_normally, unsupported
from .stats import ShuttleStats
from .sync_loads import PrefixCache, SyncLoadGuard

log = logging.getLogger("vllm.kvshuttle")  # under vLLM's logger: its handler shows INFO lines
CONSUMED = PREFIX + "consumed"  # set in a request's params once its load is scheduled: never load twice


class ShuttleScheduler:
    def __init__(self, config: ShuttleConfig, engine_id: str, block_size: int,
                 secret: DeploymentSecret | None = None, tp_size: int = 1, num_layers: int = 0,
                 cpu_host: bool = False, cache_dtype: str = "") -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.num_layers = num_layers  # 0: unknown
        self.cpu_host = cpu_host  # the CPU platform: host threads copy a read's bytes on the compute cores
        # What this cache's bytes mean: named in every handle issued here, and a handle naming another is refused.
        self.cache_dtype = cache_dtype
        self.policy = replace(config.policy(), cache_dtype=cache_dtype)
        self._terms = config.terms()
        self.secret = secret if secret is not None else config.deployment_secret()
        self._grants = GrantBook(self.secret)  # grants checked at arrival, each good for one request
        self._ranks: tuple[ShuttleHandshake, ...] = ()  # every rank's side channel, once all reported
        self._releases: list[str] = []  # retentions that ended on some rank: end them on every rank
        self._ending: set[str] = set()  # of the held requests, those every rank was told to end
        # TP > 1 with a host tier: requests whose blocks vLLM freed while their retention may live on in the tier
        # (a demotion landed on every rank); one rank's end of it is still every rank's
        self._tiered: set[str] = set()
        # request -> (local hit, decision, handle, layered), awaiting its allocation
        self._decisions: dict[str, tuple[int, Decision, KVHandle, bool]] = {}
        self._loads: list[LoadJob] = []
        self._retains: list[RetainJob] = []
        self._publications: list[Publication] = []
        self._held: set[str] = set()  # requests whose blocks wait for the worker's finished_sending
        self._awaiting: set[str] = set()  # requests whose load went to the worker, until finished_recving
        self._reads: dict[str, tuple[int, frozenset[int]]] = {}  # request -> (tokens read, target blocks)
        self._warned: set[str] = set()
        self.counts: dict[str, int] = {}
        # A layered load's blocks are held out of vLLM's prefix cache until its step reports (sync_loads.py); no
        # layered load without it. None until bound to the engine's cache (``bind_prefix_cache``).
        self.sync_loads: SyncLoadGuard | None = None
        self.prefix_cache_bound = False
        # The deployment's content index (kvshuttle_content_index): a request without a handle finds a retained
        # prefix by its digests; this decode's retentions are published there. None: off.
        self.lookups: ContentLookups | None = None
        self._by_content: set[str] = set()  # requests whose load came from the index (their params say nothing)
        self._indexed: dict[str, str] = {}  # request -> handle id of the retentions published, until they end

    def bind_prefix_cache(self, cache: PrefixCache | None) -> None:
        """The engine's prefix cache (``compat.engine_prefix_cache``; None: not found, layered loads are read
        asynchronously instead)."""
        self.prefix_cache_bound = True
        self.sync_loads = SyncLoadGuard(cache, self.block_size, self.tp_size) if cache is not None else None

    # -- where the workers serve ------------------------------------------------------------------------
    @property
    def address(self) -> ShuttleHandshake | None:
        """Rank 0's side channel (the handle's ``host:port``), once every rank reported its own."""
        return self._ranks[0] if self._ranks else None

    @address.setter
    def address(self, handshake: ShuttleHandshake | None) -> None:
        self.set_ranks({} if handshake is None else {0: handshake})

    def set_ranks(self, metadata: dict[int, Any]) -> None:
        """Every tensor-parallel rank's handshake (vLLM's ``{tp_rank: metadata}``). Nothing is retained until
        all ``tp_size`` ranks reported a side channel: a handle must name every shard."""
        ranks = [metadata.get(rank) for rank in range(self.tp_size)]
        if len(metadata) != self.tp_size or not all(isinstance(r, ShuttleHandshake) and r.tp_rank == k
                                                    for k, r in enumerate(ranks)):
            self._ranks = ()
            if metadata:
                self._warn_once("ranks", f"kvshuttle: {len(metadata)} of {self.tp_size} ranks reported a side "
                                         f"channel (ranks {sorted(metadata)[:8]}); nothing is retained")
            return
        self._ranks = tuple(r for r in ranks if isinstance(r, ShuttleHandshake))
        if self.lookups is not None and self._ranks:  # its retentions name rank 0's side channel
            self.lookups.serve_as(self._ranks[0].address)

    # -- admission ------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to read beyond the local hit, and whether asynchronously (vLLM waits for the read, then schedules
        the suffix) or not (layer-pipelined: computed in this step); (0, False) to compute them. No side effects
        on vLLM's state: it may ask again for the same request."""
        self._decisions.pop(request.request_id, None)  # asked again: decide afresh
        params = request.kv_transfer_params
        if self.config.retain == "granted" and isinstance(params, dict) and GRANT_FIELD in params:
            self._grants.admit(request.request_id, params[GRANT_FIELD])  # at arrival: covers a long answer
        if (isinstance(params, dict) and params.get(CONSUMED)) or request.request_id in self._by_content:
            return 0, False  # loaded once already (the same request after a preemption)
        if not isinstance(params, dict) or not params or (PREFIX + "version") not in params:
            if isinstance(params, dict) and params.get("remote_block_ids") and (PREFIX + "version") not in params:
                self._warn_once("foreign", "kvshuttle: kv_transfer_params from another connector (no kvshuttle "
                                           "handle): they cannot be verified, recomputing")
                return 0, False
            found = self._find_by_content(request)
            if found is None:
                return 0, False
            if found is PENDING:
                return None, False  # asked again next step; the lookup is bounded (content_lookups.py)
            params = found
        if params.get("do_remote_decode") and not self.config.bidirectional:
            self._warn_once("bidir", "kvshuttle: a decode handle reached this engine, but bidirectional_kv_xfer is "
                                     "off here: recomputing (enable it on prefill and decode)")
            return 0, False
        why = unsupported(request)
        if why:
            self._warn_once("unsupported", f"kvshuttle: request {request.request_id} carries a handle but {why}: "
                                           "its tokens do not name its KV, recomputing (logged once)")
            return 0, False
        handle = parse_handle(params, secret=self.secret, local_hit_tokens=num_computed_tokens)
        if not isinstance(handle, KVHandle):  # absent, malformed, forged or edited: nothing is contacted
            self._record(request.request_id, handle)
            return 0, False
        decision = decide(request.prompt_token_ids, local_hit_tokens=num_computed_tokens, handle=handle,
                          now_wall=time.time(), config=self._salted(request))
        tokens = decision.fetch_token_range
        if decision.fetch and (tokens.start != num_computed_tokens or tokens.start % self.block_size):
            self._count("misaligned")
            log.info("kvshuttle: request %s recomputes, because the verified range starts at token %d, not at the "
                     "local hit's end on a block boundary", request.request_id, tokens.start)
            return 0, False
        if not decision.fetch:
            self._record(request.request_id, decision)
            return 0, False
        layered = self._layered(decision, handle)
        whole = decision.whole_blocks() if layered else None
        if whole is None:  # less than a block to read layer by layer: read it the asynchronous way
            layered = False
        else:
            decision = whole
        self._decisions[request.request_id] = (num_computed_tokens, decision, handle, layered)
        return decision.fetch_tokens, not layered  # layered: a synchronous load, computed in this step

    def _find_by_content(self, request: Any) -> dict[str, Any] | object | None:
        """The signed params of the retention holding the longest indexed prefix of this request's prompt, PENDING,
        or None (no index, nothing found in time, or a request whose tokens do not name its KV)."""
        if self.lookups is None or not self.config.bidirectional or unsupported(request):
            return None
        found = self.lookups.find(request.request_id, self._scope(request), request.prompt_token_ids,
                                  self._salted(request).extra_key)
        if found is PENDING or found is None:
            return found
        return dict(found.params)  # type: ignore[attr-defined]

    @staticmethod
    def _scope(request: Any) -> str:
        """The index scope of a request: its cache_salt (a tenant's, set by the router), or the shared one."""
        salt = getattr(request, "cache_salt", None)
        return salt if isinstance(salt, str) else ""

    def _layered(self, decision: Decision, handle: KVHandle) -> bool:
        """Whether to read this fetch layer by layer (``kvshuttle_load_mode``). ``auto``: not on a CPU host (the
        read's copy shares the cores the forward pass computes on: measured slower than the asynchronous load,
        benchmarks/README.md), and only where the reads are direct (owner and reader at the same TP size: whole
        heads; a head slice is packed and lands whole), the model has more than one layer to overlap, and the cost
        model expects the read to take at most half of ``kvshuttle_layered_timeout_s``, the longest it may hold up
        the step's forward pass (no estimate: no layered read). Either mode needs the guard that keeps the load's
        blocks out of vLLM's prefix cache until they landed (``sync_loads.py``)."""
        mode = self.config.load_mode
        if mode == "auto":
            if decision.cost is None or self.cpu_host or handle.tp_size != self.tp_size or self.num_layers == 1 \
                    or decision.cost.transfer_s > self.config.layered_timeout_s / 2:
                return False
        elif mode != "layered":
            return False
        if self.sync_loads is None:  # its blocks could reach the prefix cache before they land: read asynchronously
            self._warn_once("layered_without_guard", "kvshuttle: layer-pipelined loads need the engine's prefix cache "
                                                     "(to keep a load's blocks out of it until they landed), which "
                                                     "this vLLM does not expose; reading asynchronously instead")
            return False
        return True

    def _salted(self, request: Any) -> PolicyConfig:
        """The policy for ``request``: its ``cache_salt`` (a tenant's prefix-cache isolation, set by the router)
        goes into every block digest, so a handle issued under one salt never verifies a prompt under another."""
        salt = getattr(request, "cache_salt", None)
        if not salt:
            return self.policy
        return replace(self.policy, extra_key=salted_key(self.policy.extra_key, salt))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        held = self._decisions.get(request.request_id)  # kept until the commit: fail_load needs it
        if num_external_tokens <= 0 or held is None:
            self._decisions.pop(request.request_id, None)
            if num_external_tokens > 0:  # vLLM waits for a load this side never planned: report it failed
                self.fail_load(request, blocks, num_external_tokens, "no decision was held for it")
            return
        local_hit, decision, handle, layered = held
        table = block_table(blocks)
        first = local_hit // self.block_size
        local = tuple(table[first:first + blocks_for_tokens(decision.fetch_tokens, self.block_size)])
        job = LoadJob(request.request_id, handle, decision, local, len(request.prompt_token_ids), time.monotonic(),
                      layered=layered)
        self._record(request.request_id, decision)
        if layered:  # vLLM cached the blocks just now: out until the load landed (fail_load reports it if this fails)
            self._hold(request, first, local)
        # commit last (nothing below can fail): a load is queued exactly when vLLM waits for it
        del self._decisions[request.request_id]
        if isinstance(request.kv_transfer_params, dict) and (PREFIX + "version") in request.kv_transfer_params:
            request.kv_transfer_params[CONSUMED] = True  # the same dict survives preemption: never load twice
        else:  # found by content: the request's own params (if any) name no handle
            self._by_content.add(request.request_id)
        self._reads[request.request_id] = (decision.fetch_tokens, frozenset(local))
        self._loads.append(job)
        if not layered:  # vLLM waits for finished_recving only for an asynchronous load
            self._awaiting.add(request.request_id)

    def _hold(self, request: Any, first: int, blocks: tuple[int, ...]) -> None:
        """Keep a synchronous load's blocks out of vLLM's prefix cache until it landed (``sync_loads.py``). If vLLM's
        cache is not what ``compat`` expects, no later load is layered."""
        if self.sync_loads is None:
            return
        try:
            self.sync_loads.hold(request, first, blocks)
        except Exception:
            self.sync_loads = None
            self._warn_once("sync_loads_broken", "kvshuttle: vLLM's prefix cache refused the layered-load guard; "
                                                 "every later load is read asynchronously")
            raise

    def fail_load(self, request: Any, blocks: Any, num_external_tokens: int, why: str) -> None:
        """vLLM waits for ``num_external_tokens`` of ``request`` that will not come (a bug on this side): queue a
        load the worker reports at once as failed, its target blocks invalid, so vLLM recomputes them instead of
        waiting forever (vLLM has no timeout for a load)."""
        request_id = request.request_id
        if any(job.request_id == request_id for job in self._loads):  # its load is queued already
            return
        held = self._decisions.pop(request_id, None)
        local_hit = held[0] if held is not None else 0
        try:
            table = block_table(blocks)
        except Exception:
            table = []
        first = local_hit // self.block_size
        local = tuple(table[first:first + blocks_for_tokens(num_external_tokens, self.block_size)])
        decision = held[1] if held is not None else Decision("recompute", Reason.NO_HANDLE, why)
        layered = held is not None and held[3]  # a synchronous load: its blocks are reported invalid, nothing else
        self._reads.pop(request_id, None)
        self._loads.append(LoadJob(request_id, None, decision, local, 0, time.monotonic(), failure=why,
                                   layered=layered))
        if not layered:
            self._awaiting.add(request_id)
        self._count("load_failed")
        if layered and self.sync_loads is not None and request_id not in self.sync_loads:
            self._hold(request, first, local)  # its blocks were cached at allocation: out until recomputed

    def build_connector_meta(self) -> ShuttleMetadata:
        meta = ShuttleMetadata(self._loads, self._retains, self._publications, self._releases)
        self._loads, self._retains, self._publications, self._releases = [], [], [], []
        return meta

    # -- finished requests ----------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Decide everything first, then commit: nothing after the commit can fail, so a True answer always
        has its RetainJob queued (vLLM keeps the blocks only for the worker's finished_sending)."""
        request_id = request.request_id
        if self.sync_loads is not None:  # (before vLLM frees the blocks)
            self.sync_loads.finished(request)
        self._decisions.pop(request_id, None)
        read, _ = self._reads.pop(request_id, (0, frozenset()))
        params = request.kv_transfer_params
        job, out = self._retention(request, block_ids, params, read)
        publication = self._publication(request_id, params, out)
        self._grants.finish(request_id)
        self._by_content.discard(request_id)
        if self.lookups is not None:
            self.lookups.forget(request_id)
        if job is not None:
            self._retains.append(job)
            self._held.add(request_id)
            self._count("retained")
            if self.lookups is not None and out is not None and out.get("do_remote_decode"):
                self.lookups.publish(self._scope(request), job.digests, job.num_tokens, out,
                                     time.time() + self._terms.handle_ttl(job.ttl_s))
                self._indexed[request_id] = job.handle_id
        if publication is not None:
            self._publications.append(publication)
        return job is not None, out

    def forget(self, request: Any) -> None:
        """Drop every trace of ``request`` here (a hook failed for it); a router waiting for its publication is
        told that nothing was retained."""
        request_id = getattr(request, "request_id", None)
        if not isinstance(request_id, str):
            return
        self._decisions.pop(request_id, None)
        self._reads.pop(request_id, None)
        self._grants.finish(request_id)
        self._by_content.discard(request_id)
        if self.lookups is not None:
            self.lookups.forget(request_id)
        params = getattr(request, "kv_transfer_params", None)
        key = params.get(PUBLISH_KEY) if isinstance(params, dict) else None
        if key is not None and request_id not in self._held:
            with contextlib.suppress(KVShuttleError):
                self._publications.append(Publication(request_id, check_publish_key(key), None))

    def _publication(self, request_id: str, params: Any, out: dict[str, Any] | None) -> Publication | None:
        key = params.get(PUBLISH_KEY) if isinstance(params, dict) else None
        if key is None:  # a streaming router takes the params from the worker's board (board.py)
            return None
        if self.config.retain == "granted" and not self._grants.granted(request_id, params.get(GRANT_FIELD)):
            self._count("publish_refused_no_grant")  # a direct client must not fill the bounded board
            return None
        try:
            return Publication(request_id, check_publish_key(key), out)
        except KVShuttleError as exc:
            self._warn_once("publish_key", f"kvshuttle: not publishing request {request_id}: {exc}")
            return None

    def _retention(self, request: Any, block_ids: Any, params: Any,
                   read: int) -> tuple[RetainJob | None, dict[str, Any] | None]:
        """The RetainJob and returned params for a finished request, or (None, None); no side effects but
        counters."""
        if not isinstance(params, dict) or not params or not finished_normally(request):
            return None, None
        prefill = bool(params.get("do_remote_decode"))  # this engine prefilled for a decode
        if not prefill and not self.config.bidirectional:
            return None, None
        why = unsupported(request)
        if why:
            self._warn_once("unsupported", f"kvshuttle: request {request.request_id} not retained: {why}, so its "
                                           "tokens do not name its KV (logged once)")
            return None, None
        if self.config.retain == "granted" and not self._grants.granted(request.request_id, params.get(GRANT_FIELD)):
            self._warn_once("retain_refused_no_grant",
                            f"kvshuttle: request {request.request_id} not retained: its kv_transfer_params carry no "
                            f"valid {GRANT_FIELD} (a router of this deployment grants retention; set "
                            "kvshuttle_retain: \"always\" behind a proxy that sends none). Logged once, counted")
            return None, None
        if self.address is None:
            self._warn_once("address", "kvshuttle: the worker has not reported its side channel; nothing retained")
            return None, None
        tokens = int(request.num_computed_tokens)
        table = block_table(block_ids)[:blocks_for_tokens(tokens, self.block_size)]
        if tokens <= 0 or len(table) != blocks_for_tokens(tokens, self.block_size):
            return None, None
        ttl = self.config.prefill_ttl_s if prefill else self.config.decode_ttl_s
        life = self._terms.handle_ttl(ttl)  # with a host tier: the hot TTL and then the tier's (demotions.py)
        now = time.time()
        digests = tuple(block_digests(list(request.all_token_ids[:tokens]), self.block_size,
                                      extra_key=self._salted(request).extra_key))
        ranks = tuple(r.address for r in self._ranks) if self.tp_size > 1 else ()
        once = prefill or self.config.reads == "use_once"  # a prompt is read by its one decode
        handle = KVHandle(self.engine_id, request.request_id, self.address.host, self.address.port, tuple(table),
                          tokens, now + life, self.tp_size, secrets.token_urlsafe(18), 0, self.block_size, digests,
                          now, life, ranks, self.cache_dtype, "use_once" if once else "multi_read")
        job = RetainJob(request.request_id, handle.handle_id, handle.block_ids, digests, tokens, self.block_size,
                        ttl, once, ranks, self.cache_dtype)
        out = handle.to_kv_transfer_params(self.secret)  # fresh: the request's grant is never echoed
        # vLLM's proxy protocol: a prefill's params send its decode to read (do_remote_prefill); a decode's
        # send the next turn's prefill to read back (do_remote_decode).
        out.update(do_remote_prefill=prefill, do_remote_decode=not prefill, transfer_mode="pull")
        out[PREFIX + "read_tokens"] = read  # what this request itself read from its peer (proof of reuse)
        return job, out

    def update_connector_output(self, finished_sending: set[str] | None, invalid_block_ids: set[int] | None,
                                finished_recving: set[str] | None = None,
                                ended: set[str] | None = None,
                                landed: dict[str, int] | None = None) -> tuple[set[str], set[str]]:
        """Take the workers' report; returns (finished_sending, finished_recving) as vLLM may see them: ids this
        side never kept, or never scheduled a load for, or already saw reported, are dropped (counted, logged
        once). vLLM asserts on such an id, and that would take the whole EngineCore down.

        ``ended``: requests whose retention ended on some rank (``ShuttleWorkerMeta``). With tensor parallelism
        the next step tells every rank to end them too, so that an eviction, release, expiry or use-once read
        on one rank frees the blocks (vLLM frees them when every rank reported) and no rank serves a handle
        another rank dropped; with a host tier also when the end comes in the very report that frees the request
        (another rank's report may be its landing). ``landed``: the layered loads each rank settled whole in the
        step reported (with ``invalid_block_ids``, what the prefix-cache guard needs to release or drop their
        blocks)."""
        if self.sync_loads is not None:
            self.sync_loads.settle(landed, invalid_block_ids)
        ends = set(ended or ())
        if self.tp_size > 1 and ends:  # not those freed in this very report (every rank's TTL sweep at once)
            news = sorted((ends & (self._held - set(finished_sending or ()))) - self._ending)
            self._releases.extend(news)
            self._ending.update(news)
            tiered = sorted(ends & self._tiered)  # ended on some rank's tier: every rank ends it
            self._releases.extend(tiered)
            self._tiered.difference_update(tiered)
        sending, recving = set(finished_sending or ()), set(finished_recving or ())
        stray = (sending - self._held) | (recving - self._awaiting)
        if stray:
            self.counts["stray_report"] = self.counts.get("stray_report", 0) + len(stray)
            self._log_once("stray_report", f"kvshuttle: the worker reported requests {sorted(stray)[:5]} that this "
                                            "side holds no blocks or load for; not passed on to vLLM")
        sending &= self._held
        recving &= self._awaiting
        if self.lookups is not None:  # retentions that ended: no lookup should find them any more
            tier = self._terms.tier is not None
            for request_id in sending | ends:
                if tier and request_id not in ends:  # its blocks went back as its demotion landed: the tier serves
                    continue  # it under the same handle until it ends (the worker reports that in ``ended``)
                handle_id = self._indexed.pop(request_id, None)
                if handle_id is not None:
                    self.lookups.withdraw(handle_id)
        if self.tp_size > 1 and self._terms.tier is not None:  # freed by a landing, not an end: may live on
            freed = (sending & self._held) - self._ending
            self._tiered.update(freed - ends)
            # Ended on some rank in the report that frees it: another rank's report may be a landing (its tier
            # still holds a copy no reader can use), so every rank ends it.
            self._releases.extend(sorted(freed & ends))
        self._held -= sending
        self._ending -= sending
        self._awaiting -= recving
        if invalid_block_ids:  # a read that failed: vLLM recomputes those blocks, so nothing was reused
            for request_id, (_, blocks) in list(self._reads.items()):
                if blocks & invalid_block_ids:
                    self._reads[request_id] = (0, blocks)
                    self._count("load_failed")
        return sending, recving

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def state_sizes(self) -> dict[str, int]:
        """How many entries each per-request structure holds (all return to 0 when no request is in flight)."""
        return {"decisions": len(self._decisions), "loads": len(self._loads), "retains": len(self._retains),
                "publications": len(self._publications), "held": len(self._held), "reads": len(self._reads),
                "awaiting": len(self._awaiting), "releases": len(self._releases),
                "ending": len(self._ending), "sync_loads": len(self.sync_loads or ()), "tiered": len(self._tiered)}

    def take_stats(self) -> ShuttleStats:
        """Decisions counted since the last call (vLLM merges them with the worker's)."""
        if self.sync_loads is not None:
            for what, n in self.sync_loads.counts.items():
                self.counts[f"sync_load.{what}"] = self.counts.get(f"sync_load.{what}", 0) + n
            self.sync_loads.counts = {}
        if self.lookups is not None:
            for what, n in self.lookups.take_counts().items():
                self.counts[f"index.{what}"] = self.counts.get(f"index.{what}", 0) + n
        stats, self.counts = ShuttleStats.counting(self.counts, "decision"), {}
        return stats

    def _record(self, request_id: str, decision: Decision) -> None:
        self._count(decision.reason.value)
        if decision.fetch:
            log.info("kvshuttle: request %s reads %d tokens (%s)", request_id, decision.fetch_tokens, decision.message)
        elif decision.reason.value != "no_handle":
            log.info("kvshuttle: request %s recomputes, because %s: %s", request_id, decision.reason.value,
                     decision.message)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _warn_once(self, key: str, message: str) -> None:
        self._count(key)
        self._log_once(key, message)

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
