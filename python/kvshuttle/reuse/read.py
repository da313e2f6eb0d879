"""The reuse read: one request's decide -> claim -> read -> wait -> finish, or recompute with a reason.

This is the whole serving-path contract in one call, used by the demo and by the vLLM connector. In go the
decode's handle (``kv_transfer_params``, untrusted), the new prompt (token ids or precomputed
:class:`~kvshuttle.policy.PromptDigests`), the local prefix-cache hit and the request's local block table;
out comes a :class:`ReuseResult`: the tokens now valid in the local cache, the local blocks that are not,
the token range still to compute, and why.

Every refusal or failure on the way is a result, never an exception: a malformed or tampered handle, an
unverified or expired range, a refused claim, an unreachable or lost decode, a failed or slow read, blocks
reused on the decode while we read them. Then only the local hit counts, and every local block the read
may have touched is reported invalid: nothing unverified or partially written is reported as reusable.
Only caller bugs raise (:class:`ReuseArgumentError`, :class:`~kvshuttle.policy.PolicyError`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.blocks import as_ids, blocks_for_tokens
from ..errors import KVShuttleError, shown
from ..policy import Decision, KVHandle, PolicyConfig, PromptDigests, decide, decide_from_params, parse_handle
from ..policy.digests import TokenIds
from ..transfer import LayerProgress, Peer, Settlement, TransferEngine, TransferError
from ..transfer.config import PATHS, Path
from ..transfer.control import rank_addresses, release_on_ranks, renew_on_ranks
from .owners import OwnerPool
from .ranks import RankedFetch, check_rank_args
from .results import Failure, ReuseArgumentError, ReuseResult, failed_result, not_fetched

__all__ = ["Failure", "ReuseArgumentError", "ReuseReader", "ReuseResult"]

log = logging.getLogger(__name__)


class ReuseReader:
    """Reuse reads for one prefill worker: its engine, policy and a cache of connected decodes.

    Handles are authenticated under the engine's deployment secret before anything else: a forged or edited one
    recomputes without a single connection attempt. ``allowed_owners`` (hosts, or ``host:port``), when given,
    limits where reads may come from. A decode that fails (unreachable, lost, timed out) is refused at once
    for ``cooldown_s`` (a circuit breaker: no reconnect per request, so requests behind a dead decode do not
    queue up), then reconnected by the next request that names it. A read that times out from a decode that still
    answers (heartbeats) does not trip it: that decode is busy, not dead. But while such a read is still in flight
    (NIXL could not cancel it: quarantined), requests naming that decode recompute at once (``peer_stalled``)
    instead of adding reads to a data path that does not move. ``timeout_s`` bounds claim + read +
    confirmation of one request. ``tp_rank``/``tp_size``: this reader's tensor-parallel rank (its engine's cache
    is that rank's head shard) and ``num_kv_heads`` the model's total KV heads (required at ``tp_size > 1``):
    when either side runs tensor parallel a fetch reads this rank's heads from every owner rank involved, all
    or nothing (:mod:`kvshuttle.reuse.ranks`). Safe to use from several threads at once (the vLLM worker's loads run
    concurrently): reads from one decode share its connection, reads from different decodes never wait on
    each other's.
    """

    def __init__(self, engine: TransferEngine, policy: PolicyConfig | None = None, *, timeout_s: float = 10.0,
                 path: Path = "auto", clock: Callable[[], float] = time.time, cooldown_s: float = 5.0,
                 allowed_owners: Collection[str] | None = None, tp_rank: int = 0, tp_size: int = 1,
                 num_kv_heads: int | None = None) -> None:
        if not isinstance(path, str) or path not in PATHS:
            raise ReuseArgumentError(f"path must be one of {PATHS}, not {shown(path)}")
        for name, value in (("timeout_s", timeout_s), ("cooldown_s", cooldown_s)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ReuseArgumentError(f"{name} must be a positive number of seconds, got {shown(value)}")
        if allowed_owners is not None and not all(isinstance(a, str) and a for a in allowed_owners):
            raise ReuseArgumentError("allowed_owners must be host or host:port strings")
        self.engine = engine
        self.secret = engine.secret
        self.policy = policy or PolicyConfig()
        self.timeout_s = float(timeout_s)
        self.cooldown_s = float(cooldown_s)
        self.owners = OwnerPool(engine, cooldown_s=cooldown_s, allowed_owners=allowed_owners)
        self.allowed_owners = self.owners.allowed_owners
        self.tp_rank, self.tp_size, self.num_kv_heads = check_rank_args(engine, tp_rank, tp_size, num_kv_heads)
        self._ranked = RankedFetch(engine, self.owners, path, self.tp_rank, self.tp_size, self.num_kv_heads,
                                   self.timeout_s)
        self._clock = clock

    @property
    def path(self) -> Path:
        """The path reads prefer (``auto``, ``direct`` or ``packed``); settable between reads."""
        return self._ranked.path

    @path.setter
    def path(self, value: Path) -> None:
        self._ranked = replace(self._ranked, path=value)

    def read(self, kv_transfer_params: Any, prompt: TokenIds | PromptDigests, *, local_hit_tokens: int,
             local_block_ids: Sequence[int] | np.ndarray[Any, Any], clock_offset_s: float = 0.0) -> ReuseResult:
        """Reuse what can be verified and read for one prompt; see the module docstring.

        ``local_block_ids``: the request's local block table in token order (block k holds tokens
        ``[k*B, (k+1)*B)`` of the local block size), covering at least the whole prompt.
        """
        started = time.perf_counter()
        num_tokens = _length(prompt)
        handle = parse_handle(kv_transfer_params, secret=self.secret)
        if isinstance(handle, KVHandle):
            decision = decide(prompt, local_hit_tokens=local_hit_tokens, handle=handle, now_wall=self._clock(),
                              config=self.policy, clock_offset_s=clock_offset_s)
        else:  # malformed, forged, unverifiable or absent: the policy says why, we recompute
            decision = decide_from_params(prompt, kv_transfer_params, local_hit_tokens=local_hit_tokens,
                                          now_wall=self._clock(), config=self.policy, secret=self.secret)
            if decision.reason.value == "unauthenticated_handle":
                log.warning("kvshuttle: recompute, because %s", decision.message)
        local_ids = self._targets(decision, local_block_ids, num_tokens)
        if not decision.fetch or not isinstance(handle, KVHandle):
            return not_fetched(decision, started, num_tokens)
        if local_ids is None:
            return failed_result(decision, started, num_tokens, Failure.MISALIGNED, (),
                                f"the verified range starts at token {decision.fetch_token_range.start}, not "
                                f"where the local hit of {decision.local_tokens} tokens ends on a local block")
        return self.fetch(decision, handle, local_ids, num_tokens, started=started)

    def renew(self, kv_transfer_params: Any, ttl_s: float | None = None) -> dict[str, Any] | None:
        """Keep a decode's retention alive (a conversation still active); the refreshed params, or None when
        it cannot be renewed (malformed, forged, gone, decode unreachable): then the next turn will recompute."""
        handle = parse_handle(kv_transfer_params, secret=self.secret)
        if not isinstance(handle, KVHandle):
            return None
        try:  # every owner rank holds its own retention of the handle
            return renew_on_ranks(self._owner_ranks(handle), handle, ttl_s, self.engine.config.connect_timeout_s)
        except TransferError as exc:
            log.info("kvshuttle: retention %s... not renewed: %s", handle.handle_id[:8], exc)
            return None

    def release(self, kv_transfer_params: Any) -> bool:
        """Let a decode free a conversation's blocks now; False when there was nothing (left) to free."""
        handle = parse_handle(kv_transfer_params, secret=self.secret)
        if not isinstance(handle, KVHandle):
            return False
        try:
            return release_on_ranks(self._owner_ranks(handle, reachable=True), handle,
                                    self.engine.config.connect_timeout_s)
        except TransferError as exc:
            log.info("kvshuttle: retention %s... not released: %s", handle.handle_id[:8], exc)
            return False

    def close(self) -> None:
        """Forget every connected decode (the engine itself stays open)."""
        self.owners.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _targets(self, decision: Decision, local_block_ids: Any, num_tokens: int) -> npt.NDArray[np.int64] | None:
        """The local blocks the fetched tokens land in; None when they do not start on a local block."""
        bs = self.engine.cache.geometry.block_size
        try:
            table = as_ids(local_block_ids)  # one array, no per-block Python on the serving path
        except (KVShuttleError, TypeError, ValueError, OverflowError):
            raise ReuseArgumentError("local_block_ids must be a sequence of integers") from None
        if len(table) < blocks_for_tokens(num_tokens, bs):
            raise ReuseArgumentError(f"{len(table)} local blocks of {bs} tokens cannot hold the {num_tokens}-token "
                                     "prompt; pass the request's whole block table")
        if not decision.fetch:
            return table[:0]
        tokens = decision.fetch_token_range
        if tokens.start != decision.local_tokens or tokens.start % bs:
            return None
        first = tokens.start // bs
        return table[first:first + blocks_for_tokens(len(tokens), bs)]

    def _owner_ranks(self, handle: KVHandle, *, reachable: bool = False) -> list[Peer]:
        """The connected owner ranks of ``handle`` (one for a single owner), in rank order; ``reachable``: only
        those that answer (the first error when none does)."""
        peers: list[Peer] = []
        error: TransferError | None = None
        for address in rank_addresses(handle):
            try:
                peers.append(self.owners.peer_at(*address.removeprefix("tcp://").rsplit(":", 1)))
            except TransferError as exc:
                if not reachable:
                    raise
                error = error or exc
        if not peers and error is not None:
            raise error
        return peers

    def hold_off(self, address: str, settled: Settlement) -> None:
        """Refuse reads from owner ``address`` at once (``peer_stalled``) until ``settled``: a read from it passed
        its deadline and NIXL still reports it in flight."""
        self.owners.hold_off(address, settled)

    def fetch(self, decision: Decision, handle: KVHandle, local_ids: Sequence[int] | npt.NDArray[np.int64],
              num_tokens: int, *, started: float | None = None, unknown_grace_s: float = 0.0,
              deadline: float | None = None, progress: LayerProgress | None = None) -> ReuseResult:
        """Claim, read and confirm what ``decision`` (a fetch) names into ``local_ids``: the second half of
        :meth:`read`, for a caller that decided elsewhere (vLLM's scheduler decides, its worker fetches).

        ``handle`` must be authenticated already (:func:`~kvshuttle.policy.parse_handle` with the secret).
        ``unknown_grace_s``: how long to retry a claim the owner refuses as unknown (its ledger may learn of a
        just-issued handle a step later than the reader got it). ``deadline`` (``time.monotonic()``; default
        ``timeout_s`` from now): when the whole fetch must be over, counted by the caller from when it decided,
        so time spent queued counts too. ``progress``: read layer by layer (where the path is direct) and report
        each layer on it as it lands, for a forward pass that computes layer i while later layers still arrive;
        it is ended when the fetch is over (``ok`` only once every rank confirmed the read).
        """
        started = time.perf_counter() if started is None else started
        local_ids = np.asarray(local_ids, dtype=np.int64)
        deadline = time.monotonic() + self.timeout_s if deadline is None else min(deadline, time.monotonic()
                                                                                   + self.timeout_s)
        # one implementation for every TP pair: a single owner is owner rank 0 of TP=1, read as one head slice
        return self._ranked.fetch(decision, handle, local_ids, num_tokens, started=started,
                                  unknown_grace_s=unknown_grace_s, deadline=deadline, progress=progress)


def _length(prompt: TokenIds | PromptDigests) -> int:
    if isinstance(prompt, PromptDigests):
        return prompt.num_tokens
    try:
        return len(prompt)
    except TypeError:
        raise ReuseArgumentError(f"prompt must be token ids or PromptDigests, got {type(prompt).__name__}") from None

