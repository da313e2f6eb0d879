"""Stateful property tests of the retention ledger against a model of decode's block allocator.

The model owns 16 blocks of 4 tokens. Requests allocate free blocks, write tokens and are retained; a later
turn continues a handle's token sequence, sharing its blocks (copy-on-write for a partial last block someone
else already appended to), as a paged cache with prefix caching does. The owner may also take a block back
(``block_freed``) or, buggy, reuse a retained block silently. Checked after every step: the ledger holds exactly
the blocks the model gave it, none of them free; ``on_free`` gets only retained blocks, each once, never one
pinned by a live claim; the budget holds; generations only grow; an expired, stale, released or consumed handle
is never served and a read that raced with a reuse is reported.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvshuttle.retention import (
    MODES,
    BudgetExceededError,
    ClaimLostError,
    HandleUnavailableError,
    RetentionLedger,
    StaleHandleError,
    TamperedHandleError,
)

N, B, CLAIM_TIMEOUT = 16, 4, 3.0
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=6)


def chain_digests(tokens: tuple[int, ...], blocks: int) -> list[bytes]:
    """Block k's digest covers every token up to the end of block k (position and content)."""
    return [hashlib.sha256(repr(tokens[: (k + 1) * B]).encode()).digest()[:8] for k in range(blocks)]


@dataclass
class MHandle:
    handle_id: str
    generation: int
    blocks: tuple[int, ...]
    tokens: tuple[int, ...]
    digests: tuple[bytes, ...]
    expiry: float
    conversation: str | None
    gone: set[str] = field(default_factory=set)  # end reasons the model knows of
    stale: bool = False  # a block went back to the owner (or was reused) after it was issued


@dataclass
class MClaim:
    claim_id: str
    handle: MHandle
    blocks: tuple[int, ...]
    deadline: float
    taken_back: bool = False  # one of its blocks was taken back while the read was in flight


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.free: set[int] = set(range(N))
        self.held: set[int] = set()
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (index, tokens written into it)
        self.handles: list[MHandle] = []
        self.claims: list[MClaim] = []
        self.gens = [0] * N
        self.budget: int | None = None
        self.mode = "multi_read"
        self.ledger = RetentionLedger("d", "h", 1)

    @initialize(mode=st.sampled_from(MODES), budget=st.sampled_from([None, 2, 3, 4, 6, 10]),
                ttl=st.sampled_from([8.0, 30.0]))
    def setup(self, mode: str, budget: int | None, ttl: float) -> None:
        self.mode, self.budget, self.ttl = mode, budget, ttl
        self.ledger = RetentionLedger("d", "h", 1, ttl_s=ttl, mode=mode, budget_blocks=budget,  # type: ignore[arg-type]
                                      claim_timeout_s=CLAIM_TIMEOUT, clock=lambda: self.now,
                                      wall_clock=lambda: 1e9 + self.now, on_free=self.on_free)

    # --------------------------------------------------------------------------------------- the owner
    def on_free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert b in self.held and b not in self.free, f"block {b} handed back but not retained"
            pinned = [c for c in self.claims if b in c.handle.blocks and self.now < c.deadline and not c.taken_back]
            assert not pinned, f"block {b} freed under a live claim"
            self.held.remove(b)
            self.free.add(b)
            self.content.pop(b, None)

    def take_back(self, b: int) -> None:
        """Everything issued that includes ``b`` is stale from now on."""
        for h in self.handles:
            h.stale |= b in h.blocks
        for c in self.claims:
            c.taken_back |= b in c.blocks

    def issue(self, blocks: list[int], tokens: tuple[int, ...], conversation: str | None) -> None:
        for k, b in enumerate(blocks):
            self.content[b] = (k, tokens[k * B: (k + 1) * B])
        digests = chain_digests(tokens, len(blocks))
        fresh = {b for b in blocks if b not in self.held}
        self.held |= set(blocks)
        try:
            handle = self.ledger.retain("r", blocks, digests, len(tokens), B, conversation_id=conversation)
        except BudgetExceededError as err:
            assert self.budget is not None and fresh <= set(err.caller_frees) <= set(blocks)
            self.held -= set(err.caller_frees)
            self.free |= set(err.caller_frees)
            for b in err.caller_frees:
                self.content.pop(b, None)
            return
        assert handle.block_ids == tuple(blocks) and handle.expiry_time == handle.issued_at + handle.ttl_s
        self.handles.append(MHandle(handle.handle_id, handle.generation, tuple(blocks), tokens, tuple(digests),
                                    self.now + self.ttl, conversation))

    def pick(self, data: st.DataObject) -> MHandle:
        """A handle: mostly one of the newest three (old ones are mostly gone) or one being read."""
        where = data.draw(st.sampled_from(["recent", "recent", "reading", "any"]))
        reading = [c.handle for c in self.claims]
        pool = self.handles[-3:] if where == "recent" else reading if where == "reading" and reading else self.handles
        return data.draw(st.sampled_from(pool))

    def allocate(self, data: st.DataObject, count: int) -> list[int]:
        if count == 0:
            return []
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.free)), min_size=count, max_size=count, unique=True))
        self.free -= set(blocks)
        return blocks

    @precondition(lambda self: self.free)
    @rule(data=st.data(), tokens=TOKENS, conversation=st.sampled_from([None, "a", "b"]))
    def retain_fresh(self, data: st.DataObject, tokens: list[int], conversation: str | None) -> None:
        count = min(-(-len(tokens) // B), len(self.free))
        self.issue(self.allocate(data, count), tuple(tokens[: count * B]), conversation)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), more=TOKENS)
    def retain_next_turn(self, data: st.DataObject, more: list[int]) -> None:
        """Continue a handle whose blocks decode still holds with the same content (a prefix-cache hit)."""
        h = self.pick(data)
        views = [(k, h.tokens[k * B: (k + 1) * B]) for k in range(len(h.blocks))]
        if not all(b in self.held for b in h.blocks) or any(
                self.content[b] != view for b, view in zip(h.blocks[:-1], views, strict=False)):
            return
        tokens = h.tokens + tuple(more)
        blocks = list(h.blocks)
        cow = self.content[blocks[-1]] != views[-1]  # someone appended to our partial block: copy on write
        if cow and len(h.tokens) % B == 0:
            return
        extra = -(-len(tokens) // B) - len(blocks)
        if extra + cow > len(self.free):  # (checked before allocating: a block taken and not issued would leak)
            return
        if cow:
            blocks[-1] = self.allocate(data, 1)[0]
        self.issue(blocks + self.allocate(data, extra), tokens, h.conversation)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), silently=st.booleans(), tokens=TOKENS)
    def owner_takes_back(self, data: st.DataObject, silently: bool, tokens: list[int]) -> None:
        """The owner reclaims a retained block and says so (``block_freed``), or, buggy, writes it at another
        position in a new request without saying so: either way its holders must never be served again."""
        self.take_back_block(data, data.draw(st.sampled_from(sorted(self.held))), silently, tokens)

    def take_back_block(self, data: st.DataObject, b: int, silently: bool, tokens: list[int]) -> None:
        self.take_back(b)
        if silently and (self.free or self.content[b][0] != 0):
            blocks = [b] if self.content[b][0] != 0 else [*self.allocate(data, 1), b]
            self.issue(blocks, tuple((tokens * 8)[: (len(blocks) - 1) * B + 1]), None)
            return
        self.ledger.block_freed(b)
        self.held.remove(b)
        self.free.add(b)
        self.content.pop(b, None)

    # -------------------------------------------------------------------------------------- the reader
    def refusable(self, h: MHandle) -> set[str]:
        reasons = set(h.gone)
        if self.now >= h.expiry:
            reasons.add("expired")
        if h.stale:
            reasons.add("stale")
        if self.budget is not None and not any(c.handle is h and self.now < c.deadline for c in self.claims):
            reasons.add("evicted")  # the ledger's choice, never while a read is in flight
        return reasons

    def must_refuse(self, h: MHandle) -> bool:
        return bool(h.gone - {"evicted"}) or self.now >= h.expiry or h.stale or "evicted" in h.gone

    def check_refusal(self, h: MHandle, err: HandleUnavailableError, *, claiming: bool) -> None:
        if err.reason == "in_use":
            assert claiming and self.mode == "use_once" and any(c.handle is h for c in self.claims)
            return
        assert err.reason in self.refusable(h), f"refused as {err.reason}, model allows {self.refusable(h)}"
        h.gone.add(err.reason)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), prefix=st.integers(0, 4), read_now=st.booleans(),
          tamper=st.sampled_from([None, None, None, "generation", "ids", "digests"]))
    def claim(self, data: st.DataObject, prefix: int, read_now: bool, tamper: str | None) -> None:
        """Claim a handle (possibly presenting a prefix, possibly tampered); ``read_now``: complete at once."""
        c = self.try_claim(self.pick(data), prefix, tamper)
        if c is not None and read_now:
            self.finish(c, complete=True)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), prefix=st.integers(0, 4), tokens=TOKENS,
          event=st.sampled_from(["block_freed", "reuse", "timeout", "pressure", "release", "expiry"]))
    def read_with_interference(self, data: st.DataObject, prefix: int, tokens: list[int], event: str) -> None:
        """Something happens between a claim and its complete: the complete must tell a good read from a bad."""
        c = self.try_claim(self.pick(data), prefix, None)
        if c is None:
            return
        held = sorted(self.held.intersection(c.blocks))
        if event in ("block_freed", "reuse") and held:
            self.take_back_block(data, data.draw(st.sampled_from(held)), event == "reuse", tokens)
        elif event == "timeout":
            self.now = c.deadline
        elif event == "pressure":  # a request that fits only if everything evictable goes
            room = len(self.free) if self.budget is None else self.budget - self.ledger.metrics()["pinned_blocks"]
            count = min(len(self.free), room)
            if count > 0:
                self.issue(self.allocate(data, count), tuple((tokens * 99)[: count * B]), None)
        elif event == "release" and self.ledger.release(c.handle.handle_id):
            c.handle.gone.add("released")
        elif event == "expiry":
            self.now = max(self.now, c.handle.expiry)
            self.ledger.sweep()
        self.finish(c, complete=True)

    def try_claim(self, h: MHandle, prefix: int, tamper: str | None) -> MClaim | None:
        count = min(prefix, len(h.blocks)) or len(h.blocks)
        ids, digests, generation = list(h.blocks[:count]), list(h.digests[:count]), h.generation
        if tamper == "generation":
            generation += 1
        elif tamper == "ids":
            ids[-1] = (ids[-1] + 1) % N if (ids[-1] + 1) % N not in ids else N + 7
        elif tamper == "digests":
            digests[0] = b"forged!!"
        try:
            claim = self.ledger.claim(h.handle_id, generation, ids, digests)
        except HandleUnavailableError as err:
            self.check_refusal(h, err, claiming=True)
            return None
        except TamperedHandleError:
            assert tamper is not None
            return None
        assert tamper is None, "a tampered handle was served"
        assert not self.must_refuse(h), f"served a handle that is {self.refusable(h)}"
        if self.mode == "use_once":
            assert not any(c.handle is h and self.now < c.deadline for c in self.claims), "two use-once readers"
        assert claim.block_ids == h.blocks[:count] and claim.deadline == self.now + CLAIM_TIMEOUT
        self.claims.append(MClaim(claim.claim_id, h, claim.block_ids, claim.deadline))
        return self.claims[-1]

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), complete=st.booleans())
    def end_claim(self, data: st.DataObject, complete: bool) -> None:
        self.finish(data.draw(st.sampled_from(self.claims)), complete=complete)

    def finish(self, c: MClaim, *, complete: bool) -> None:
        self.claims.remove(c)
        if not complete:
            assert self.ledger.abort(c.claim_id) or self.now >= c.deadline
            return
        try:
            self.ledger.complete(c.claim_id)
        except ClaimLostError:
            assert self.now >= c.deadline
            return
        except StaleHandleError:
            assert c.taken_back and self.now < c.deadline
            return
        assert not c.taken_back and self.now < c.deadline, "a read that raced with a reuse was accepted"
        h = c.handle
        if self.mode == "use_once":
            h.gone.add("consumed")
        elif not self.must_refuse(h):
            assert self.ledger.get(h.handle_id) is not None, "a handle vanished while it was being read"

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), ttl=st.sampled_from([None, 1.0, 30.0]))
    def renew(self, data: st.DataObject, ttl: float | None) -> None:
        h = self.pick(data)
        try:
            wire = self.ledger.renew(h.handle_id, ttl)
        except HandleUnavailableError as err:
            self.check_refusal(h, err, claiming=False)
            return
        assert not self.must_refuse(h), f"renewed a handle that is {self.refusable(h)}"
        h.expiry = max(h.expiry, self.now + (self.ttl if ttl is None else ttl))
        assert abs(wire.ttl_s - (h.expiry - self.now)) < 1e-6

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        h = self.pick(data)
        if self.ledger.release(h.handle_id):
            assert not (h.gone or h.stale), f"released a handle that is {h.gone}"
            h.gone.add("released")
        else:
            assert self.must_refuse(h) or self.budget is not None
            h.gone.add("evicted" if not self.must_refuse(h) else "released")

    @rule(conversation=st.sampled_from(["a", "b"]))
    def close_conversation(self, conversation: str) -> None:
        self.ledger.close_conversation(conversation)
        for h in self.handles:
            if h.conversation == conversation:
                h.gone.add("released")

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 6.0]), sweep=st.booleans())
    def advance(self, dt: float, sweep: bool) -> None:
        self.now += dt
        if sweep:
            self.ledger.sweep()

    @precondition(lambda self: self.handles or self.claims)
    @rule(data=st.data())
    def advance_to_an_edge(self, data: st.DataObject) -> None:
        """Land exactly on a deadline: expiry and claim timeouts are exclusive ends."""
        edges = [h.expiry for h in self.handles] + [c.deadline for c in self.claims]
        edge = data.draw(st.sampled_from(edges))
        self.now = max(self.now, edge)

    # ------------------------------------------------------------------------------------- invariants
    @invariant()
    def ledger_holds_exactly_what_it_was_given(self) -> None:
        retained = self.ledger.retained_block_ids()
        assert retained == self.held, f"ledger holds {sorted(retained)}, model {sorted(self.held)}"
        assert not retained & self.free and self.held | self.free == set(range(N))
        metrics = self.ledger.metrics()
        assert metrics["retained_blocks"] == len(self.held) and metrics["pinned_blocks"] <= len(self.held)
        assert metrics["draining_handles"] >= 0 and metrics["live_handles"] <= len(self.handles)

    @invariant()
    def a_handle_being_read_is_never_evicted(self) -> None:
        for c in self.claims:
            if self.now < c.deadline and not self.must_refuse(c.handle):
                assert self.ledger.get(c.handle.handle_id) is not None, "a handle vanished while being read"

    @invariant()
    def budget_is_never_exceeded(self) -> None:
        assert self.budget is None or len(self.ledger.retained_block_ids()) <= self.budget

    @invariant()
    def generations_only_grow(self) -> None:
        gens = [self.ledger.generation(b) for b in range(N)]
        assert all(new >= old for new, old in zip(gens, self.gens, strict=True))
        self.gens = gens


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestLedgerMachine = LedgerMachine.TestCase
