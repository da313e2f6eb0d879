"""The what-if simulation: replay a trace under one cost profile, per mode, TTL and threshold.

A discrete-event replay in arrival order. Each conversation is closed-loop: a turn arrives ``gap_s`` after the
previous turn's answer ended, so faster turns bring the next ones forward (or, ``one_at_a_time``, item 8, one
client sends every turn in turn). Per turn:

1. **Local prefix cache** (modes ``local_cache``, ``reverse_read+local_cache``): the prefill worker the turn is
   routed to (``prefill_workers``: at random, seeded, or by :class:`Placement`) holds whole blocks of the prompts
   it computed or read earlier, in an LRU of ``profile.prefill_cache_gib`` shared by every conversation on that
   worker (partial eviction from the least recently used entry's tail, as vLLM frees a request's tail blocks
   first). A prefill worker never holds an answer (decode generated it) unless pre-warmed (item 6). The hit is
   the cached prefix the new prompt still shares, in whole blocks, never the last prompt token.
2. **Reverse read** (modes ``reverse_read*``): the previous turn's decode retained its prompt + answer (minus
   the last sampled token, which has no KV yet) until ``end + TTL``. The decision is kvshuttle's own policy,
   :func:`kvshuttle.policy.decide`, on real block digests of synthetic token ids (an edited history verifies
   only its shared prefix), the local hit, the handle's expiry at the turn's arrival (``expiry_margin_s``) and
   the threshold (``kv_recompute_threshold`` semantics, or ``"cost"``: the policy's cost model with this
   profile's numbers).
3. **TTFT** = queueing (only with ``queue``: one request at a time per prefill worker) + ``prefill_fixed_s`` +
   the read (whole blocks) + computing the rest after the reused prefix; with ``layered``, the read and the
   compute pipelined layer by layer (:meth:`.CostProfile.layered_s`; the read is then cut to whole blocks, as
   the connector cuts it). **Turn latency** = TTFT + decode.
4. **Retention**: a handle holds its blocks on decode from its turn's end until the TTL expires or the
   conversation's next request arrives (that request reads it, or declines and releases it, as vLLM's
   notify-only message does), whichever comes first; a conversation's last handle until its TTL. One handle per
   conversation at a time: with decode's prefix cache on, a continuation's next handle shares the old one's
   blocks. The running requests' own KV is not counted. Without reverse reads nothing is retained.
5. **Bytes** (``bytes_moved``, ``retained``): over all of the profile's ``tp_size`` ranks, every replica counted
   (:meth:`.CostProfile.block_bytes`): what the reads move in total and what decode holds across its ranks. A
   read's time is one rank's share (:meth:`.CostProfile.transfer_s`: the ranks read at once).

6. **Placement** (:class:`Placement`, the router's settings): ``affinity`` keeps each conversation on one prefill
   worker (its home: ``homes`` when given, else conversation index modulo workers) instead of a random one, or
   (``round_robin``) the next worker in arrival order, as ``kvshuttle router --affinity none`` does;
   ``prewarm`` (with affinity and a local cache) puts the history, prompt *and* answer as the next prompt
   renders them, into the home worker's cache when the gap before the next turn is long enough to compute the
   answer's tokens there (off the TTFT path); ``decode_local_tokens`` (reverse-read modes: the router finds the
   decode through the handle) sends a turn whose new tokens (the router's estimate over the new messages) are at
   most that many to the decode, which reuses what it retained (the shared prefix, in whole blocks) and
   computes the rest: no prefill, no read.
7. **Re-tokenized answers** (``PreparedTrace(answer_kept_tokens=)``): the next prompt carries the answer as the
   chat template re-renders it, as text re-tokenized; only its first ``answer_kept_tokens`` tokens may equal the
   ids decode generated (``None``: all of them). The decode's retained KV (a read, a decode-local turn) then
   shares at most the previous prompt and those tokens; a pre-warmed prefill, which computed the re-rendered
   history, shares all of it. ``kvshuttle plan --validate-placement`` (the tiny random model) keeps 0.
8. **One client** (``one_at_a_time``): a benchmark client with one request in flight, conversations in turn
   round by round (c0, c1, ... then the next round, as ``kvshuttle bench placement``): a turn is sent when the
   previous request's answer ended and at least its ``gap_s`` after its own conversation's previous answer.

Not modelled: batching several requests into one prefill step, decode contention (a decode-local turn's compute
delays the decode's other requests: measured by ``kvshuttle bench placement --bystander``), read failures (a failed
read recomputes: that would cost a read *and* a recompute), prefill workers of different speeds (every worker runs
at the profile's), a decode-local turn's own fixed cost (it pays the profile's prefill fixed cost, hand-off to the
decode included), and the router's text estimate of a turn's new tokens (decode-local decides on their token
count).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..policy import KVHandle, PolicyConfig, PromptDigests, block_digests, decide
from ..retention.terms import DEFAULT_TTL_S
from .errors import PlannerError
from .profile import GIB, CostProfile
from .tiers import HOT_PRICE_PER_GIB_HOUR, Tier, check_tiers, split_hold, tier_at
from .trace import Trace

Mode = Literal["cache_miss", "local_cache", "reverse_read", "reverse_read+local_cache"]
MODES: tuple[Mode, ...] = ("cache_miss", "local_cache", "reverse_read", "reverse_read+local_cache")
BASELINES: tuple[Mode, ...] = ("cache_miss", "local_cache")
Threshold = int | Literal["cost"]
_TOKEN_HIGH = 1 << 31


@dataclass(frozen=True)
class _Prepared:
    """One turn's fixed facts: its prompt's digests, what decode holds after it, what it shares."""

    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    gap_s: float
    shared: int  # tokens the prompt shares with the previous turn's prompt + answer as generated (0 on turn 1)
    rendered_shared: int  # ... with the previous prompt + answer as the chat template re-renders it (0 on turn 1)
    digests: PromptDigests
    handle_tokens: int  # KV tokens decode holds after this turn (prompt + answer - 1)
    handle_digests: tuple[bytes, ...]


class PreparedTrace:
    """Token ids and digests per turn, computed once for every mode and setting (seeded per conversation).

    ``answer_kept_tokens``: how many of an answer's generated token ids its re-rendered text keeps in the next
    prompt (module docstring, item 7; ``None``: all)."""

    def __init__(self, trace: Trace, block_size: int, *, progress: bool = False,
                 answer_kept_tokens: int | None = None) -> None:
        if answer_kept_tokens is not None and answer_kept_tokens < 0:
            raise PlannerError(f"answer_kept_tokens must be >= 0 or None, got {answer_kept_tokens!r}")
        self.trace = trace
        self.block_size = block_size
        self.answer_kept_tokens = answer_kept_tokens
        self.turns: list[list[_Prepared]] = []
        convs: Iterable[Any] = trace.conversations
        if progress:
            from tqdm import tqdm

            convs = tqdm(convs, desc="digesting turns", unit="conv", leave=False)
        for index, conv in enumerate(convs):
            rng = np.random.default_rng(index)
            rendered: npt.NDArray[np.uint32] | None = None  # the previous prompt + answer as re-rendered
            generated = 0  # of which tokens equal what decode generated (its retained KV)
            prepared = []
            for spec in conv.turns:
                if rendered is None:
                    shared = rendered_shared = 0
                    prompt = _fresh(rng, spec.prompt_tokens)
                else:
                    limit = spec.edit_at if spec.edit_at is not None else spec.history_tokens
                    rendered_shared = min(spec.history_tokens, len(rendered), limit)
                    shared = min(rendered_shared, generated)
                    prompt = np.concatenate([rendered[:rendered_shared],
                                             _fresh(rng, spec.history_tokens - rendered_shared),
                                             _fresh(rng, spec.new_tokens)])
                answer = _fresh(rng, spec.output_tokens)
                seq = np.concatenate([prompt, answer])
                held = len(seq) - 1
                handle_digests = tuple(block_digests(seq[:held], block_size)) if held > 0 else ()
                prepared.append(_Prepared(spec.prompt_tokens, spec.new_tokens, spec.output_tokens, spec.gap_s,
                                          shared, rendered_shared, PromptDigests.from_tokens(prompt, block_size),
                                          held, handle_digests))
                kept = len(answer) if answer_kept_tokens is None else min(answer_kept_tokens, len(answer))
                # the re-rendered answer: its first ``kept`` ids as generated, then other ids (fresh, so never equal)
                rendered = np.concatenate([prompt, answer[:kept], _fresh(rng, len(answer) - kept)])
                generated = len(prompt) + kept
            self.turns.append(prepared)

    def common_prefix(self, conv: int, older: int, newer: int, with_answer: bool = False) -> int:
        """Tokens prompt ``newer`` shares with prompt ``older`` of one conversation (ids are never reused), or
        with prompt ``older`` and its answer as the next prompt renders it (``with_answer``: a pre-warmed
        history)."""
        turns = self.turns[conv]
        common = turns[older].handle_tokens + 1 if with_answer else turns[older].prompt_tokens
        for k in range(older + 1, newer + 1):
            common = min(common, turns[k].rendered_shared)
        return common


def _fresh(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint32]:
    return rng.integers(0, _TOKEN_HIGH, size=max(n, 0), dtype=np.uint32)


@dataclass(frozen=True)
class Placement:
    """The router's placement settings (module docstring, item 6). ``homes``: with affinity, conversation ``i``'s
    prefill worker is ``homes[i]`` (a router's measured homes); empty: ``i`` modulo the workers. ``round_robin``:
    without affinity, workers in turn by arrival (else at random)."""

    affinity: bool = False
    prewarm: bool = False
    decode_local_tokens: int = 0
    round_robin: bool = False
    homes: tuple[int, ...] = ()

    def worker(self, conv: int, arrival_index: int, workers: int, route: np.random.Generator) -> int:
        """The prefill worker conversation ``conv``'s turn goes to (the ``arrival_index``-th turn of the run)."""
        if self.affinity:
            return self.homes[conv] if self.homes else conv % workers
        if self.round_robin:
            return arrival_index % workers
        return int(route.integers(workers))


NO_PLACEMENT = Placement()  # random routing, no pre-warming, no decode-local turns


class _PrefixCache:
    """One prefill worker's prefix cache: per conversation the whole blocks of its latest prompt (or, pre-warmed,
    of its latest prompt and answer), LRU."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.capacity = capacity_tokens
        self.block_size = block_size
        self.entries: OrderedDict[int, tuple[int, int]] = OrderedDict()  # conv -> (tokens, turn)
        self.total = 0
        self.answered: set[int] = set()  # conversations whose entry holds the answer too (pre-warmed)

    def hit(self, prepared: PreparedTrace, conv: int, turn: int) -> int:
        entry = self.entries.get(conv)
        if entry is None:
            return 0
        self.entries.move_to_end(conv)
        tokens, older = entry
        prompt = prepared.turns[conv][turn].prompt_tokens
        shared = prepared.common_prefix(conv, older, turn, with_answer=conv in self.answered)
        common = min(tokens, shared, prompt - 1)
        return max(common, 0) // self.block_size * self.block_size

    def store(self, conv: int, turn: int, prompt_tokens: int, with_answer: bool = False) -> None:
        tokens = min(prompt_tokens // self.block_size * self.block_size, self.capacity)
        old = self.entries.pop(conv, (0, 0))[0]
        self.total += tokens - old
        self.entries[conv] = (tokens, turn)
        (self.answered.add if with_answer else self.answered.discard)(conv)
        while self.total > self.capacity:
            victim, (held, k) = next(iter(self.entries.items()))
            cut = min(held, self.total - self.capacity)
            cut = -(-cut // self.block_size) * self.block_size
            self.total -= min(cut, held)
            if held - cut <= 0:
                del self.entries[victim]
            else:
                self.entries[victim] = (held - cut, k)
                self.entries.move_to_end(victim, last=False)


@dataclass
class ModeRun:
    """One simulation's per-turn records and retention intervals."""

    mode: Mode
    ttl_s: float
    threshold: Threshold
    prompt: list[int] = field(default_factory=list)
    later: list[bool] = field(default_factory=list)  # a turn after the first of its conversation
    ttft: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    local: list[int] = field(default_factory=list)
    fetched: list[int] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    bytes_moved: list[float] = field(default_factory=list)  # over all TP ranks
    reasons: Counter[str] = field(default_factory=Counter)
    retained: list[tuple[float, float, float]] = field(default_factory=list)  # (start, stop, bytes on all ranks)
    tiers: tuple[Tier, ...] = ()  # the lower tiers after the hot one (planner/tiers.py)
    # per lower tier: its retention intervals, and the turns that read from it
    tier_retained: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    tier_reads: Counter[str] = field(default_factory=Counter)
    turn_keys: list[tuple[int, int]] = field(default_factory=list)  # (conversation, turn) per record


def policy_config(threshold: Threshold, profile: CostProfile, expiry_margin_s: float) -> PolicyConfig:
    """The policy the connector would run: vLLM's ``kv_recompute_threshold`` semantics, or the cost model (with
    one TP rank's bytes per token and its link's bandwidth: each rank's connector reads its own shard)."""
    if threshold == "cost":
        return PolicyConfig(kind="cost", kv_bytes_per_token=profile.rank_kv_bytes_per_token,
                            bandwidth_bytes_per_s=profile.bandwidth_bytes_per_s,
                            transfer_overhead_s=profile.transfer_overhead_s,
                            prefill_tokens_per_s=profile.prefill_tokens_per_s, expiry_margin_s=expiry_margin_s)
    return PolicyConfig.from_vllm_threshold(int(threshold), expiry_margin_s=expiry_margin_s)


def _handle(turn: _Prepared, block_size: int, end: float, ttl_s: float, conv: int, k: int) -> KVHandle | None:
    if turn.handle_tokens <= 0:
        return None
    return KVHandle(engine_id="decode-0", request_id=f"c{conv}t{k}", host="127.0.0.1", port=5600,
                    block_ids=tuple(range(len(turn.handle_digests))), num_tokens=turn.handle_tokens,
                    expiry_time=end + ttl_s, tp_size=1, handle_id=f"{conv:016x}{k:016x}", generation=1,
                    block_size=block_size, digests=turn.handle_digests, issued_at=end, ttl_s=ttl_s)


def simulate(prepared: PreparedTrace, profile: CostProfile, *, mode: Mode, ttl_s: float = DEFAULT_TTL_S,
             threshold: Threshold = 64, expiry_margin_s: float = 5.0, prefill_workers: int = 1,
             queue: bool = False, seed: int = 0, layered: bool = False,
             placement: Placement = NO_PLACEMENT, one_at_a_time: bool = False,
             tiers: Sequence[Tier] = ()) -> ModeRun:
    """Replay ``prepared`` in one mode and setting (see the module docstring). ``tiers``: lower retention tiers a
    retention moves down to when its hot TTL (``ttl_s``) ends, each read back at its own speed (planner/tiers.py)."""
    tiers = check_tiers(tiers)
    life_s = ttl_s + sum(t.ttl_s for t in tiers)  # a retention's whole life over every tier
    if mode not in MODES:
        raise PlannerError(f"mode must be one of {MODES}, got {mode!r}")
    if placement.prewarm and not (placement.affinity and mode.endswith("local_cache")):
        raise PlannerError("pre-warming needs affinity (the next turn's worker is known) and a local cache mode")
    if not (math.isfinite(ttl_s) and ttl_s >= 0) or prefill_workers < 1:
        raise PlannerError(f"need a finite TTL >= 0 and prefill_workers >= 1, got {ttl_s!r}, {prefill_workers!r}")
    if placement.homes and (len(placement.homes) < len(prepared.turns)
                            or not all(0 <= h < prefill_workers for h in placement.homes)):
        raise PlannerError(f"homes {placement.homes} must name a worker in [0, {prefill_workers}) for each of the "
                           f"{len(prepared.turns)} conversations")
    if prepared.block_size != profile.block_size:
        raise PlannerError(f"trace prepared for block size {prepared.block_size}, profile has {profile.block_size}")
    reverse, local = mode.startswith("reverse_read"), mode.endswith("local_cache")
    config = policy_config(threshold, profile, expiry_margin_s)
    bs = profile.block_size
    caches = [_PrefixCache(profile.prefill_cache_tokens, bs) for _ in range(prefill_workers)]
    route = np.random.default_rng(seed)
    free_at = [0.0] * prefill_workers
    ends: dict[int, float] = {}
    run = ModeRun(mode, ttl_s, threshold, tiers=tiers, tier_retained={t.name: [] for t in tiers})
    serial = _serial_order(prepared) if one_at_a_time else []
    events = [] if one_at_a_time else [(turns[0].gap_s, conv, 0) for conv, turns in enumerate(prepared.turns) if turns]
    heapq.heapify(events)
    client_free = 0.0  # one_at_a_time: when the client's previous request ended
    while events or serial:
        if one_at_a_time:
            conv, k = serial.pop(0)
            ready = ends[conv] + prepared.turns[conv][k].gap_s if k else prepared.turns[conv][0].gap_s
            arrival = max(client_free, ready)
        else:
            arrival, conv, k = heapq.heappop(events)
        turns = prepared.turns[conv]
        turn = turns[k]
        worker = placement.worker(conv, len(run.ttft), prefill_workers, route) if prefill_workers > 1 else 0
        on_decode = reverse and k > 0 and _decode_local(turns, k, placement, ends[conv] + ttl_s > arrival)
        tier = tier_at(arrival - ends[conv], ttl_s, tiers) if k else 0
        local_tokens = caches[worker].hit(prepared, conv, k) if local and k and not on_decode else 0
        fetched, blocks, reason = 0, 0, "first_turn" if k == 0 else "off"
        pipelined = False
        if on_decode:  # the decode reuses what it retained and computes the rest: no prefill, no read
            local_tokens, reason = _decode_reuse(turns, k, bs), "decode_local"
        elif reverse and k:
            handle = _handle(turns[k - 1], bs, ends[conv], life_s, conv, k - 1)
            if handle is None:
                reason = "no_handle"
            else:
                d = decide(turn.digests, local_hit_tokens=local_tokens, handle=handle, now_wall=arrival,
                           config=config)
                reason, local_tokens = d.reason.value, d.local_tokens
                if d.fetch:  # layered: whole blocks, or (less than one) the asynchronous read, as the connector
                    whole = d.whole_blocks() if layered and tier == 0 else None  # lower tiers: asynchronous
                    pipelined = whole is not None
                    chosen = whole or d
                    fetched, blocks = chosen.fetch_tokens, len(chosen.fetch_blocks)
        compute = turn.prompt_tokens - local_tokens - fetched
        if pipelined:
            service = profile.prefill_fixed_s + profile.layered_s(blocks, compute, local_tokens + fetched)
        else:
            read_s = tiers[tier - 1].read_s(profile.rank_block_bytes(blocks)) if blocks and tier > 0 \
                else profile.transfer_s(blocks)
            service = profile.prefill_fixed_s + read_s + profile.compute_s(compute, local_tokens + fetched)
        if blocks and tier > 0:
            run.tier_reads[tiers[tier - 1].name] += 1
        start = max(arrival, free_at[worker]) if queue and not on_decode else arrival
        if not on_decode:
            free_at[worker] = start + service
        ttft = start - arrival + service
        dec = profile.decode_s(turn.output_tokens)
        end = arrival + ttft + dec
        ends[conv] = client_free = end
        if local and not on_decode:
            caches[worker].store(conv, k, turn.prompt_tokens)
        if local and placement.prewarm and k + 1 < len(turns) and \
                turns[k + 1].gap_s >= profile.prefill_fixed_s + profile.compute_s(turn.output_tokens,
                                                                                   turn.prompt_tokens):
            caches[worker].store(conv, k, turn.handle_tokens + 1, with_answer=True)  # warmed in the gap
        if reverse and turn.handle_tokens > 0:
            hold = min(life_s, turns[k + 1].gap_s) if k + 1 < len(turns) else life_s
            nbytes = profile.block_bytes(-(-turn.handle_tokens // bs))
            for where, start_s, stop_s in split_hold(end, hold, ttl_s, tiers):
                held = run.retained if where == 0 else run.tier_retained[tiers[where - 1].name]
                held.append((start_s, stop_s, nbytes))
        if k + 1 < len(turns) and not one_at_a_time:
            heapq.heappush(events, (end + turns[k + 1].gap_s, conv, k + 1))
        run.prompt.append(turn.prompt_tokens)
        run.later.append(k > 0)
        run.ttft.append(ttft)
        run.decode.append(dec)
        run.local.append(local_tokens)
        run.fetched.append(fetched)
        run.recomputed.append(compute)
        run.bytes_moved.append(profile.block_bytes(blocks))
        run.reasons[reason] += 1
        run.turn_keys.append((conv, k))
    return run


def _serial_order(prepared: PreparedTrace) -> list[tuple[int, int]]:
    """``(conversation, turn)`` round by round: every conversation's first turn, then every second turn, ..."""
    rounds = max((len(t) for t in prepared.turns), default=0)
    return [(conv, k) for k in range(rounds) for conv, turns in enumerate(prepared.turns) if k < len(turns)]


def _decode_reuse(turns: list[_Prepared], k: int, block_size: int) -> int:
    """Tokens of turn ``k``'s prompt the decode reuses from what it retained after turn ``k - 1``."""
    reuse = min(turns[k].shared, turns[k - 1].handle_tokens, turns[k].prompt_tokens - 1)
    return max(reuse, 0) // block_size * block_size


def _decode_local(turns: list[_Prepared], k: int, placement: Placement, live: bool) -> bool:
    """Whether the router sends turn ``k`` to its decode (its handle still live and few new tokens: the router
    estimates the new messages, it does not tokenize, so it cannot tell what the decode's cache will match)."""
    if not placement.decode_local_tokens or not live or turns[k - 1].handle_tokens <= 0:
        return False
    return turns[k].new_tokens <= placement.decode_local_tokens


def retained_stats(intervals: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(peak GiB, GiB-seconds)`` of retention intervals ``(start, stop, bytes)``."""
    if not intervals:
        return 0.0, 0.0
    events = sorted([(s, 1, b) for s, _, b in intervals] + [(e, 0, -b) for _, e, b in intervals])
    level = peak = 0.0
    for _, _, delta in events:  # at equal times releases (kind 0) come before retains
        level += delta
        peak = max(peak, level)
    gib_s = sum((e - s) * b for s, e, b in intervals) / GIB
    return peak / GIB, gib_s


def _stats(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def summarize(run: ModeRun) -> dict[str, Any]:
    """The metrics of one run (times in seconds, memory in GiB)."""
    later = np.asarray(run.later, dtype=bool)
    fetched = np.asarray(run.fetched)
    local = np.asarray(run.local)
    n_later = int(later.sum())
    peak, gib_s = retained_stats(run.retained)
    turn = np.asarray(run.ttft) + np.asarray(run.decode)
    tiers = {}
    for tier in run.tiers:
        tier_peak, tier_gib_s = retained_stats(run.tier_retained[tier.name])
        tiers[tier.name] = {"reads": run.tier_reads[tier.name], "retained_peak_gib": tier_peak,
                            "retained_gib_s": tier_gib_s, "cost": tier_gib_s / 3600 * tier.price_per_gib_hour}
    return {
        "mode": run.mode, "turns": len(run.ttft), "ttft_s": _stats(run.ttft), "turn_s": _stats(turn.tolist()),
        "later_ttft_s": _stats(np.asarray(run.ttft)[later].tolist()),
        "hit_rate": float((fetched[later] > 0).sum() / n_later) if n_later else 0.0,
        "local_hit_rate": float((local[later] > 0).sum() / n_later) if n_later else 0.0,
        "tokens_recomputed": int(np.sum(run.recomputed)), "tokens_fetched": int(fetched.sum()),
        "tokens_local": int(local.sum()), "bytes_moved": float(np.sum(run.bytes_moved)),
        "retained_peak_gib": peak, "retained_gib_s": gib_s, "reasons": dict(sorted(run.reasons.items())),
        "hot_cost": gib_s / 3600 * HOT_PRICE_PER_GIB_HOUR, "tiers": tiers,
    }
