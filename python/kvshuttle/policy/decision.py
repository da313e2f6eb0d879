"""Reuse or recompute: which of a decode's retained blocks one prefill request reads back, and why.

:func:`decide` runs these steps, in this order, and returns a :class:`Decision` with a reason:

0. **Same bytes.** A handle whose blocks hold another KV dtype than this cache (``PolicyConfig.cache_dtype``) is
   refused before anything else is compared: the bytes move as they are.
a. **Local hit first.** Tokens already in the prefill's prefix cache are never fetched; a fetch starts at the
   first remote block wholly after the local hit (``ceil(local / B)``).
b. **Verify.** The handle's digest chain is compared with the prompt's block by block, aligned by index
   (block k covers tokens ``[k*B, (k+1)*B)``), and cut at the first mismatch. vLLM instead trims the remote
   list from its end and serves wrong KV when history was edited or reasoning stripped (vllm#43094); here an
   edited prompt reuses only its verified prefix.
c. **Count tokens as vLLM does.** The last prompt token is always recomputed (the model needs its logits), so
   at most ``len(prompt) - 1`` tokens are reused. A remote partial last block is reusable only when its digest
   (over its ``remote_num_tokens % B`` tokens) matches the prompt's tokens there; a prompt shorter than
   ``remote_num_tokens`` reuses only the full blocks it covers (a block digest cannot vouch for part of a block).
d. **Expiry**, on the decode's clock: fetch only if ``expiry_time - (now_wall + clock_offset_s) > margin``.
   ``clock_offset_s`` is *decode wall clock minus prefill wall clock* (add it to a prefill time to get the
   decode time; :func:`estimate_clock_offset`). Exactly at the margin is expired (vLLM declines at equality
   too); NaN anywhere is expired.
e. **Threshold.** ``fixed``: fetch iff the tokens fetched ``>= threshold_tokens``; ``threshold_tokens <= 0``
   disables fetching. ``cost``: fetch iff ``(overhead + bytes / bandwidth) * cost_margin < tokens / prefill
   throughput``; :func:`kvshuttle.bench.cost_inputs.cost_inputs_from_bench` derives the transfer inputs
   from ``kvshuttle bench transfer --json``.

Anything refused, expired or unverified ends in ``"recompute"`` (``"local"`` when the local hit is still reused);
nothing unverified is ever marked for fetch. Handle problems never raise on the serving path: they become
decisions (:func:`parse_handle`, :func:`decide_from_params`). Caller bugs (a negative local hit, a bad config)
raise :class:`PolicyError`. Stdlib + numpy only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypedDict

import numpy as np

from .._values import as_float, is_int
from ..core.blocks import blocks_for_tokens
from ..errors import KVShuttleError, shown
from ..trust import DeploymentSecret
from .digests import DigestError, PromptDigests, TokenIds
from .kv_handle import PREFIX, HandleAuthError, HandleFormatError, KVHandle

Action = Literal["local", "fetch", "recompute"]
Kind = Literal["fixed", "cost"]


class PolicyError(KVShuttleError, ValueError):
    """A policy configuration or call that cannot be right (a caller bug, never a remote's fault); fix the call."""


class Reason(str, enum.Enum):
    """Why a decision came out as it did (short codes for metrics; the decision's ``message`` says more)."""

    FETCH = "fetch"
    NO_HANDLE = "no_handle"
    UNVERIFIABLE_HANDLE = "unverifiable_handle"  # a vLLM handle without kvshuttle digests
    MALFORMED_HANDLE = "malformed_handle"
    UNAUTHENTICATED_HANDLE = "unauthenticated_handle"  # no MAC, a wrong one, or an owner not trusted here
    FETCH_DISABLED = "fetch_disabled"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    CACHE_DTYPE_MISMATCH = "cache_dtype_mismatch"  # the handle's blocks hold another KV dtype than this cache
    DIGEST_SCHEME_MISMATCH = "digest_scheme_mismatch"
    NOTHING_VERIFIED = "nothing_verified"
    LOCAL_COVERS = "local_covers"
    EXPIRED = "expired"
    BELOW_THRESHOLD = "below_threshold"
    RECOMPUTE_CHEAPER = "recompute_cheaper"


@dataclass(frozen=True)
class CostEstimate:
    """The cost model's two sides for one candidate fetch (seconds)."""

    transfer_s: float
    recompute_s: float
    nbytes: int


@dataclass(frozen=True)
class Decision:
    """What to do with one request. ``fetch_blocks`` are remote block indices ``[first, last)``;
    ``remote_block_ids`` are the handle's ids for them; the fetched tokens are ``fetch_token_range``."""

    action: Action
    reason: Reason
    message: str
    local_tokens: int = 0  # prefix-cache tokens reused locally
    fetch_tokens: int = 0  # tokens whose KV is read from the decode
    reused_tokens: int = 0  # local_tokens + fetch_tokens
    fetch_blocks: range = range(0)
    remote_block_ids: tuple[int, ...] = field(default=(), repr=False)  # up to thousands: kept out of logs
    block_size: int = 0
    verified_tokens: int = 0  # remote tokens whose digests matched the prompt (before the last-token cut)
    mismatch_block: int | None = None  # first block whose digest differed, if one did
    remaining_s: float | None = None  # seconds of retention left on the decode, as estimated here
    cost: CostEstimate | None = None

    @property
    def fetch(self) -> bool:
        return self.action == "fetch"

    @property
    def fetch_token_range(self) -> range:
        start = self.fetch_blocks.start * self.block_size
        return range(start, start + self.fetch_tokens)

    def whole_blocks(self) -> Decision | None:
        """This fetch cut back to whole blocks (None when less than one block is left). A read posted while the
        forward pass writes the suffix must not share a block with it: the direct path copies whole blocks."""
        if not self.fetch or self.fetch_tokens % self.block_size == 0:
            return self
        count = self.fetch_tokens // self.block_size
        if count == 0:
            return None
        tokens = count * self.block_size
        return replace(self, fetch_tokens=tokens, reused_tokens=self.local_tokens + tokens,
                       fetch_blocks=range(self.fetch_blocks.start, self.fetch_blocks.start + count),
                       remote_block_ids=self.remote_block_ids[:count],
                       message=f"{self.message}; {tokens} tokens read (whole blocks)")


@dataclass(frozen=True)
class PolicyConfig:
    """How to decide. ``fixed``: fetch iff fetched tokens >= ``threshold_tokens`` (<= 0 disables fetching).
    ``cost``: fetch iff transfer time x ``cost_margin`` < recompute time, from the inputs below (per prefill
    worker: bytes of K+V per token over all its layers, and the bandwidth it reads with)."""

    kind: Kind = "fixed"
    threshold_tokens: int = 64
    kv_bytes_per_token: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    transfer_overhead_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    # > 1: a fetch must beat recompute by this factor: it adds a claim round trip and a failure mode, and the
    # linear recompute model underestimates long prefixes less than the bandwidth estimate overstates a busy link.
    cost_margin: float = 1.2
    expiry_margin_s: float = 5.0  # vLLM's hard-coded _KV_BLOCKS_EXPIRY_SAFETY_MARGIN
    extra_key: bytes = field(default=b"", repr=False)  # for digesting raw prompt tokens (model / adapter id)
    # This cache's KV dtype (KVHandle.cache_dtype's names); set, a handle naming another (or none) is refused:
    # bytes move as they are, so bf16 read into an fp8 cache, or e5m2 into e4m3, would be garbage. "": no check.
    cache_dtype: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.kind, str) and self.kind in ("fixed", "cost")):
            raise PolicyError(f"kind must be 'fixed' or 'cost', got {shown(self.kind)}")
        if not (is_int(self.threshold_tokens) and abs(self.threshold_tokens) < 2**63):
            raise PolicyError(f"threshold_tokens must be a 64-bit int, got {shown(self.threshold_tokens)}")
        object.__setattr__(self, "threshold_tokens", int(self.threshold_tokens))
        if not isinstance(self.extra_key, (bytes, bytearray, memoryview)):
            raise PolicyError(f"extra_key must be bytes (a model or adapter id), got {type(self.extra_key).__name__}")
        object.__setattr__(self, "extra_key", bytes(self.extra_key))
        if not isinstance(self.cache_dtype, str):
            raise PolicyError(f"cache_dtype must be a string, got {type(self.cache_dtype).__name__}")
        numbers = ("kv_bytes_per_token", "bandwidth_bytes_per_s", "transfer_overhead_s", "prefill_tokens_per_s",
                   "cost_margin", "expiry_margin_s")
        for name in numbers:  # Python floats: the cost model's products overflow to inf, never raise
            value = as_float(getattr(self, name))
            if value is None:
                raise PolicyError(f"{name} must be a real number, got {shown(getattr(self, name))}")
            object.__setattr__(self, name, value)
        if not (math.isfinite(self.expiry_margin_s) and self.expiry_margin_s >= 0):
            raise PolicyError(f"expiry_margin_s must be finite and >= 0, got {self.expiry_margin_s}")
        if self.kind == "cost":
            positive = {"kv_bytes_per_token": self.kv_bytes_per_token, "bandwidth_bytes_per_s":
                        self.bandwidth_bytes_per_s, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                        "cost_margin": self.cost_margin}
            bad = [k for k, v in positive.items() if not (math.isfinite(v) and v > 0)]
            if not (math.isfinite(self.transfer_overhead_s) and self.transfer_overhead_s >= 0):
                bad.append("transfer_overhead_s")
            if bad:
                raise PolicyError(f"the cost model needs finite positive {', '.join(bad)} "
                                  "(see kvshuttle.bench.cost_inputs.cost_inputs_from_bench for the transfer side)")

    @classmethod
    def from_vllm_threshold(cls, kv_recompute_threshold: int, **changes: Any) -> PolicyConfig:
        """vLLM's ``kv_recompute_threshold``: there ``<= 0`` means *no threshold* (always pull), here 1 token."""
        if not is_int(kv_recompute_threshold):
            raise PolicyError(f"kv_recompute_threshold must be an int, got {shown(kv_recompute_threshold)}")
        return cls(kind="fixed", threshold_tokens=max(int(kv_recompute_threshold), 1), **changes)

    def estimate(self, fetch_blocks: int, block_size: int, fetch_tokens: int) -> CostEstimate:
        """Transfer moves whole blocks; recompute redoes the fetched tokens (a linear prefill model)."""
        nbytes = fetch_blocks * block_size * self.kv_bytes_per_token  # a float: inf at worst, never an error
        return CostEstimate(self.transfer_overhead_s + nbytes / self.bandwidth_bytes_per_s,
                            fetch_tokens / self.prefill_tokens_per_s, int(min(nbytes, 2**63 - 1)))


def estimate_clock_offset(local_send: float, remote_wall: float, local_recv: float) -> float:
    """``clock_offset_s`` (decode minus prefill wall clock) from one round trip that read the decode's clock.

    The remote read is assumed halfway through the round trip (error <= half the round trip, as vLLM's).
    """
    return remote_wall - (local_send + local_recv) / 2


# ------------------------------------------------------------------------------------------------- deciding
class _Request:
    """One request's fixed facts; builds its decisions."""

    __slots__ = ("local", "num_tokens")

    def __init__(self, num_tokens: int | None, local_hit_tokens: int) -> None:
        if not (is_int(local_hit_tokens) and 0 <= local_hit_tokens < 2**63):
            raise PolicyError(f"local_hit_tokens must be an int in [0, 2**63), got {shown(local_hit_tokens)}")
        self.num_tokens = -1 if num_tokens is None else num_tokens  # None: not known (parse_handle)
        local = int(local_hit_tokens)
        # vLLM never reports the last token as hit; clamp anyway so reused_tokens <= len(prompt) - 1 holds.
        self.local = local if num_tokens is None else min(local, max(num_tokens - 1, 0))

    def refuse(self, reason: Reason, message: str, **facts: Any) -> Decision:
        action: Action = "local" if self.local > 0 else "recompute"
        return Decision(action, reason, message, local_tokens=self.local, reused_tokens=self.local, **facts)


def _prompt_length(prompt: TokenIds | PromptDigests) -> int:
    if isinstance(prompt, PromptDigests):
        return prompt.num_tokens
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise PolicyError(f"prompt must be token ids or PromptDigests, got {type(prompt).__name__}")
    return len(prompt)


def _clock(name: str, value: float) -> float:
    """A wall-clock time or offset as a float; NaN and infinities pass (they refuse as expired)."""
    number = as_float(value)
    if number is None:
        raise PolicyError(f"{name} must be a real number of seconds, got {shown(value)}")
    return number


def _first_mismatch(digests: tuple[bytes, ...], buffer: bytes, count: int, size: int) -> int:
    """Index of the first of the first ``count`` handle digests that differs from the prompt's (``count`` if none).

    One join and one memcmp in the common case (a pure continuation); one vectorised compare otherwise. Every
    position is compared, not just the last, so this holds even for digests that are not chained.
    """
    if count == 0:
        return 0
    remote = b"".join(digests[:count])
    nbytes = count * size
    if len(remote) != nbytes:
        raise HandleFormatError("the handle's digests differ in length")
    local = buffer if len(buffer) == nbytes else buffer[:nbytes]
    if remote == local:
        return count
    differs = np.frombuffer(remote, dtype=np.uint8) != np.frombuffer(local, dtype=np.uint8)
    return int(np.argmax(differs)) // size


def _prompt_digests(prompt: TokenIds | PromptDigests, handle: KVHandle, config: PolicyConfig,
                    size: int) -> PromptDigests | Reason:
    """The prompt's digests in the handle's block size and digest size, or why they cannot be had."""
    if isinstance(prompt, PromptDigests):
        resized = prompt.with_block_size(handle.block_size)
        if resized is None:
            return Reason.BLOCK_SIZE_MISMATCH
        resized = resized.with_digest_size(size)
        return Reason.DIGEST_SCHEME_MISMATCH if resized is None else resized
    # Raw tokens: digest only what the remote can cover (a prompt may be much longer than the handle).
    covered = prompt[:handle.num_tokens]
    try:
        return PromptDigests.from_tokens(covered, handle.block_size, extra_key=config.extra_key, digest_size=size)
    except DigestError as exc:  # the handle's block and digest sizes passed its checks: the tokens are wrong
        raise PolicyError(f"the prompt's token ids cannot be digested: {exc}") from None


def decide(prompt: TokenIds | PromptDigests, *, local_hit_tokens: int, handle: KVHandle | None, now_wall: float,
           config: PolicyConfig, clock_offset_s: float = 0.0) -> Decision:
    """Decide for one request. ``prompt``: its token ids, or its :class:`PromptDigests` precomputed.

    ``handle`` should come from :func:`parse_handle` (or have passed ``KVHandle.check``). ``now_wall`` is this
    process's wall clock (``time.time()``); ``clock_offset_s`` is the decode's wall clock minus ours.
    """
    request = _Request(_prompt_length(prompt), local_hit_tokens)
    if not isinstance(config, PolicyConfig):
        raise PolicyError(f"config must be a PolicyConfig, got {type(config).__name__}")
    now_wall, clock_offset_s = _clock("now_wall", now_wall), _clock("clock_offset_s", clock_offset_s)
    if handle is None:
        return request.refuse(Reason.NO_HANDLE, "no remote handle: nothing to read back")
    if not isinstance(handle, KVHandle):
        raise PolicyError(f"handle must be a KVHandle or None (parse_handle), got {type(handle).__name__}")
    if config.kind == "fixed" and config.threshold_tokens <= 0:
        return request.refuse(Reason.FETCH_DISABLED, f"threshold_tokens={config.threshold_tokens} disables fetching")
    problem = handle.structure_problem()  # O(1); a parsed handle passed the O(n) checks too
    if problem is not None:
        return request.refuse(Reason.MALFORMED_HANDLE, f"inconsistent handle: {problem}")
    if not handle.block_ids:
        return request.refuse(Reason.NOTHING_VERIFIED, "the handle offers no blocks")
    if config.cache_dtype and handle.cache_dtype != config.cache_dtype:
        return request.refuse(Reason.CACHE_DTYPE_MISMATCH, f"the handle's blocks hold "
                                                           f"{handle.cache_dtype or 'an unnamed dtype'}, this cache "
                                                           f"{config.cache_dtype}: bytes would not mean the same")
    try:
        return _decide_verified(prompt, request, handle, now_wall, config, clock_offset_s)
    except (HandleFormatError, DigestError, TypeError) as exc:  # a handle we cannot read: recompute, never raise
        return request.refuse(Reason.MALFORMED_HANDLE, f"unusable handle: {exc}")


def _decide_verified(prompt: TokenIds | PromptDigests, request: _Request, handle: KVHandle, now_wall: float,
                     config: PolicyConfig, clock_offset_s: float) -> Decision:
    bs, remote_tokens, size = handle.block_size, handle.num_tokens, len(handle.digests[0])
    digests = _prompt_digests(prompt, handle, config, size)
    if isinstance(digests, Reason):
        return request.refuse(digests, f"the prompt's digests cannot be compared with the handle's "
                                       f"(block size {handle.block_size}, {size}-byte digests) without its tokens")

    # b. verify full blocks, aligned by index, up to the first mismatch. From block 0 even under a local hit:
    # KV at block k depends on every earlier token, so an earlier mismatch disqualifies every later block.
    remote_full = remote_tokens // bs
    compared = min(remote_full, digests.num_full_blocks)
    matched = _first_mismatch(handle.digests, digests.buffer, compared, size)
    verified = matched * bs
    mismatch: int | None = matched if matched < compared else None
    # c. the remote partial last block: only if every full block matched and the prompt holds all its tokens
    if matched == remote_full < len(handle.block_ids) and request.num_tokens >= remote_tokens:
        partial = digests.partial_digest(matched, remote_tokens)
        if partial is not None and partial == handle.digests[matched]:
            verified = remote_tokens
        elif partial is not None:
            mismatch = matched

    # a + c. start after the local hit on a block boundary; end before the last prompt token
    end = min(verified, request.num_tokens - 1)
    first = blocks_for_tokens(request.local, bs)
    facts: dict[str, Any] = {"block_size": bs, "verified_tokens": verified, "mismatch_block": mismatch}
    if end <= first * bs:
        if verified == 0:
            why = (f"block {mismatch}'s digest differs from the prompt's" if mismatch is not None else
                   f"the prompt ({request.num_tokens} tokens) covers no whole remote block")
            return request.refuse(Reason.NOTHING_VERIFIED, f"no remote block verified: {why}", **facts)
        return request.refuse(Reason.LOCAL_COVERS, f"the local hit ({request.local} tokens) covers the "
                                                   f"{verified} verified remote tokens", **facts)
    last = blocks_for_tokens(end, bs)
    fetch_tokens = end - first * bs

    # d. expiry on the decode's clock; written so that NaN refuses
    remaining = handle.expiry_time - (now_wall + clock_offset_s)
    facts["remaining_s"] = remaining
    if not remaining > config.expiry_margin_s:
        return request.refuse(Reason.EXPIRED, f"{remaining:.3f} s of retention left, not more than the "
                                              f"{config.expiry_margin_s} s margin", **facts)

    # e. threshold or cost model
    cost: CostEstimate | None = None
    if config.kind == "fixed":
        if fetch_tokens < config.threshold_tokens:
            return request.refuse(Reason.BELOW_THRESHOLD, f"{fetch_tokens} tokens to fetch, below the "
                                                          f"threshold of {config.threshold_tokens}", **facts)
    else:
        cost = config.estimate(last - first, bs, fetch_tokens)
        facts["cost"] = cost
        if not cost.transfer_s * config.cost_margin < cost.recompute_s:
            return request.refuse(Reason.RECOMPUTE_CHEAPER, f"transfer {cost.transfer_s * 1e3:.3f} ms x "
                                  f"{config.cost_margin} is not below recompute {cost.recompute_s * 1e3:.3f} ms",
                                  **facts)

    cut = f"; digest mismatch at block {mismatch}" if mismatch is not None else ""
    return Decision("fetch", Reason.FETCH, f"fetch blocks [{first}, {last}): {fetch_tokens} tokens of {verified} "
                                           f"verified{cut}", local_tokens=request.local, fetch_tokens=fetch_tokens,
                    reused_tokens=request.local + fetch_tokens, fetch_blocks=range(first, last),
                    remote_block_ids=handle.block_ids[first:last], **facts)


# --------------------------------------------------------------------------------------------- the handle
def _parse(kv_transfer_params: Any, secret: DeploymentSecret | None) -> KVHandle | tuple[Reason, str]:
    if kv_transfer_params is None or (isinstance(kv_transfer_params, Mapping) and not kv_transfer_params):
        return Reason.NO_HANDLE, "no kv_transfer_params"
    if isinstance(kv_transfer_params, Mapping) and PREFIX + "version" not in kv_transfer_params:
        if "remote_block_ids" in kv_transfer_params:
            return (Reason.UNVERIFIABLE_HANDLE, "a handle without kvshuttle digests: its blocks cannot be "
                    "verified against the prompt, so they are not read (vllm#43094)")
        return Reason.NO_HANDLE, "kv_transfer_params hold no handle"
    try:
        return KVHandle.from_kv_transfer_params(kv_transfer_params, secret)
    except HandleAuthError as exc:
        return Reason.UNAUTHENTICATED_HANDLE, str(exc)
    except HandleFormatError as exc:
        return Reason.MALFORMED_HANDLE, str(exc)
    except Exception as exc:  # the serving path never raises on what a remote sent; the reason keeps the cause
        return Reason.MALFORMED_HANDLE, f"{type(exc).__name__}: {exc}"


def parse_handle(kv_transfer_params: Any, *, secret: DeploymentSecret | None,
                 local_hit_tokens: int = 0) -> KVHandle | Decision:
    """The handle in ``kv_transfer_params``, authenticated under ``secret``, or a recompute (or local) Decision
    saying why there is none (``unauthenticated_handle``: forged, edited, or naming an owner not trusted here).

    Never raises on malformed or tampered params. ``secret=None`` skips the MAC check (only for params that
    never crossed a trust boundary). ``local_hit_tokens`` only fills the Decision.
    """
    parsed = _parse(kv_transfer_params, secret)
    if isinstance(parsed, KVHandle):
        return parsed
    return _Request(None, local_hit_tokens).refuse(*parsed)


def decide_from_params(prompt: TokenIds | PromptDigests, kv_transfer_params: Any, *, local_hit_tokens: int,
                       now_wall: float, config: PolicyConfig, secret: DeploymentSecret | None,
                       clock_offset_s: float = 0.0) -> Decision:
    """:func:`parse_handle` then :func:`decide`: the serving path's one call."""
    parsed = _parse(kv_transfer_params, secret)
    if isinstance(parsed, KVHandle):
        return decide(prompt, local_hit_tokens=local_hit_tokens, handle=parsed, now_wall=now_wall, config=config,
                      clock_offset_s=clock_offset_s)
    return _Request(_prompt_length(prompt), local_hit_tokens).refuse(*parsed)


# ------------------------------------------------------------------------------------- cost model inputs
class CostInputs(TypedDict):
    """The transfer side of the cost model: ``PolicyConfig(kind="cost", prefill_tokens_per_s=..., **inputs)``.

    Plain numbers; :func:`kvshuttle.bench.cost_inputs.cost_inputs_from_bench` derives them from a measured
    ``kvshuttle bench transfer --json`` (the policy itself reads no benchmark output).
    """

    kv_bytes_per_token: float
    bandwidth_bytes_per_s: float
    transfer_overhead_s: float
