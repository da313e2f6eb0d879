"""Admission: what one tenant's requests may make the router hold, bounded before any body becomes objects.

A request enters :class:`Gate` as soon as its tenant is known, before its body is read, and leaves when its turn
ends (answered, refused, or cancelled because the client went away). While inside it counts against its tenant:

* ``tenant_max_requests`` requests inside at once (reading their body, waiting for a slot, or being served):
  one more is a 429 ``tenant_busy`` before a byte of its body is read;
* ``tenant_max_bytes``: the bytes its bodies hold, reserved at their declared length and charged, chunk by chunk
  as they are read, at what they will cost once parsed (:func:`parsed_bytes`), a 429 ``tenant_busy`` past it;
* ``tenant_max_in_flight`` turns served at once; more wait in one FIFO queue shared by every tenant, where a
  waiter whose tenant is at its cap lets the next one pass (another tenant's turns never wait behind it).

Over every tenant, ``max_held_bytes`` bounds the bytes all bodies inside hold (a 503 ``router_busy``) and
``max_in_flight`` the turns served at once. A body whose parsed form would exceed ``max_parsed_bytes`` (4 MiB
of ``{}`` is ~100 MiB of dicts) is a 413 ``body_too_complex`` as soon as the part read says so: never parsed,
never read to its end. Every check is a little work per chunk, never one long step: a flood of such bodies
leaves other tenants' turns the event loop between chunks. Once closed (SIGTERM), the gate refuses every
newcomer and waiter at once with a 503 ``router_shutting_down`` and cancels the requests still reading a body.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from .bodies import BadRequest
from .config import RouterConfig

# What parsing costs beyond the raw bytes, per structural character (measured on CPython 3.11: a dict ~64 B, a
# list ~56 B, a value string ~50 B of header, a list slot or an int ~8-32 B). Characters inside strings are
# counted too: an over-estimate for text full of braces, never an under-estimate of what a parse builds.
PER_CONTAINER, PER_QUOTE, PER_COMMA = 72, 24, 32


def parsed_bytes(raw: bytes) -> int:
    """About the most memory ``json.loads(raw)`` can build: the raw size plus the objects its structure makes."""
    containers = raw.count(b"{") + raw.count(b"[")
    return len(raw) + PER_CONTAINER * containers + PER_QUOTE * raw.count(b'"') + PER_COMMA * raw.count(b",")


@dataclass(frozen=True)
class Limits:
    """The gate's bounds (see the module docstring); :class:`~kvshuttle.router.config.RouterConfig` fills them."""

    max_in_flight: int = 128
    max_held_bytes: int = 512 << 20
    max_parsed_bytes: int = 32 << 20
    tenant_max_requests: int = 64
    tenant_max_in_flight: int = 32
    tenant_max_bytes: int = 64 << 20


def limits_of(config: RouterConfig) -> Limits:
    """The gate's bounds from the router's settings: with one shared tenant, the tenant bounds are the router's."""
    shared = not config.tenants
    return Limits(max_in_flight=config.max_in_flight, max_held_bytes=config.max_held_bytes,
                  max_parsed_bytes=config.max_parsed_bytes,
                  tenant_max_requests=config.tenant_max_requests if not shared else 1 << 30,
                  tenant_max_in_flight=config.tenant_max_in_flight if not shared else config.max_in_flight,
                  tenant_max_bytes=config.tenant_max_bytes if not shared else config.max_held_bytes)


class Ticket:
    """One request's claim on its tenant's budget, from :meth:`Gate.enter` to :meth:`Gate.leave`."""

    __slots__ = ("bytes", "parsed", "serving", "task", "tenant")

    def __init__(self, tenant: str, task: asyncio.Task[Any] | None) -> None:
        self.tenant, self.task = tenant, task
        self.bytes = 0  # charged to its tenant and the router
        self.parsed = 0  # the parsed estimate of the body read so far
        self.serving = False


class _Tenant:
    __slots__ = ("bytes", "requests", "serving")

    def __init__(self) -> None:
        self.requests = self.bytes = self.serving = 0


def _busy(message: str) -> BadRequest:
    return BadRequest(429, message, "tenant_busy")


class Gate:
    """Per-tenant and global admission; see the module docstring. One event loop's: not thread-safe."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._tenants: dict[str, _Tenant] = {}
        self._queue: deque[tuple[Ticket, asyncio.Future[None]]] = deque()
        self._reading: set[Ticket] = set()  # inside, body not yet parsed: cancelled at close
        self.held = 0  # bytes every body inside holds (raw, then parsed estimates)
        self.serving = 0
        self.closed = False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def enter(self, tenant: str, declared: int | None) -> Ticket:
        """A ticket for a request of ``tenant`` whose body declares ``declared`` bytes (None: chunked); BadRequest
        (429, 503) when the tenant or the router holds too much already. Nothing is read before this."""
        if self.closed:
            raise BadRequest(503, "the router is shutting down; retry on another replica", "router_shutting_down")
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant()
        limits = self.limits
        if state.requests >= limits.tenant_max_requests:
            raise _busy(f"this tenant has {state.requests} requests in the router already (the limit is "
                        f"{limits.tenant_max_requests}); retry once some are answered")
        ticket = Ticket(tenant, asyncio.current_task())
        state.requests += 1
        self._reading.add(ticket)
        if declared:
            try:
                self.charge(ticket, declared)
            except BadRequest:
                self.leave(ticket)
                raise
        return ticket

    def charge(self, ticket: Ticket, size: int) -> None:
        """Add ``size`` bytes to what ``ticket`` holds; BadRequest 429 (its tenant) or 503 (the router) when over."""
        state = self._tenants[ticket.tenant]
        if state.bytes + size > self.limits.tenant_max_bytes:
            raise _busy(f"this tenant's requests in the router hold {state.bytes + size} bytes with this one (the "
                        f"limit is {self.limits.tenant_max_bytes}); retry once some are answered")
        if self.held + size > self.limits.max_held_bytes:
            raise BadRequest(503, "the router holds as many request bodies as it may; retry shortly", "router_busy")
        state.bytes += size
        self.held += size
        ticket.bytes += size

    def take_chunk(self, ticket: Ticket, chunk: bytes) -> None:
        """Charge a chunk of the body at what parsing it will build (the estimate adds up over chunks); BadRequest
        413 once the body alone would build more than ``max_parsed_bytes`` (never parsed then), 429 / 503 as
        :meth:`charge`."""
        ticket.parsed += parsed_bytes(chunk)
        if ticket.parsed > self.limits.max_parsed_bytes:
            raise BadRequest(413, f"the request body would take over {self.limits.max_parsed_bytes} bytes once "
                                  "parsed (it holds that many JSON objects, arrays and values); send fewer",
                             "body_too_complex")
        if ticket.parsed > ticket.bytes:
            self.charge(ticket, ticket.parsed - ticket.bytes)

    def parsed(self, ticket: Ticket) -> None:
        """``ticket``'s body is read and parsed: no longer cancelled at close (its turn gets the grace)."""
        self._reading.discard(ticket)

    async def serve(self, ticket: Ticket) -> None:
        """Wait for a slot to serve ``ticket`` (FIFO; a waiter whose tenant is at its cap lets others pass);
        BadRequest 503 when the gate closes meanwhile."""
        if self._free(ticket):  # no waiter could take this slot: each release hands slots to those that can
            self._take(ticket)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((ticket, waiter))
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_back(ticket)  # granted in the same step the waiter was cancelled
            else:
                self._unqueue(waiter)
            raise

    def leave(self, ticket: Ticket) -> None:
        """``ticket``'s request is over: its bytes, its place and its slot go back (idempotent per ticket)."""
        self._reading.discard(ticket)
        state = self._tenants.get(ticket.tenant)
        if state is None or ticket.bytes < 0:
            return
        state.bytes -= ticket.bytes
        self.held -= ticket.bytes
        state.requests -= 1
        ticket.bytes = -1  # left
        if ticket.serving:
            self._give_back(ticket)
        self._forget_idle(ticket.tenant, state)

    def close(self) -> None:
        """Refuse every waiter and newcomer from now on, and cancel the requests still reading (shutting down)."""
        self.closed = True
        for ticket in list(self._reading):
            if ticket.task is not None and ticket.task is not asyncio.current_task():
                ticket.task.cancel()
        queue, self._queue = self._queue, deque()
        for _, waiter in queue:
            if not waiter.done():
                waiter.set_exception(BadRequest(503, "the router is shutting down; retry on another replica",
                                                "router_shutting_down"))

    # -- internals ------------------------------------------------------------------------------------------------
    def _free(self, ticket: Ticket) -> bool:
        return self.serving < self.limits.max_in_flight and \
            self._tenants[ticket.tenant].serving < self.limits.tenant_max_in_flight

    def _take(self, ticket: Ticket) -> None:
        ticket.serving = True
        self.serving += 1
        self._tenants[ticket.tenant].serving += 1

    def _give_back(self, ticket: Ticket) -> None:
        ticket.serving = False
        self.serving -= 1
        self._tenants[ticket.tenant].serving -= 1
        self._wake()

    def _wake(self) -> None:
        """Hand free slots to the first waiters that may take one (a tenant at its cap is passed over)."""
        if not self._queue or self.serving >= self.limits.max_in_flight:
            return
        for item in list(self._queue):
            if self.serving >= self.limits.max_in_flight:
                return
            ticket, waiter = item
            if waiter.done():
                self._queue.remove(item)
            elif self._free(ticket):
                self._queue.remove(item)
                self._take(ticket)
                waiter.set_result(None)

    def _unqueue(self, waiter: asyncio.Future[None]) -> None:
        for item in self._queue:
            if item[1] is waiter:
                self._queue.remove(item)
                return

    def _forget_idle(self, tenant: str, state: _Tenant) -> None:
        if state.requests == 0:  # tenants come and go (a gateway's header): keep only those inside
            self._tenants.pop(tenant, None)
