"""The router's Prometheus metrics, on a registry of its own (several routers may share a process in tests).

Names start with ``kvshuttle_router_``. Label values are fixed sets (never a tenant, conversation or URL
path), so the series count stays bounded; backends are labelled by name (a configured, finite set).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .placement import PLACEMENTS
from .token_exact import KEEPS, OUTCOMES

# Router's own time on the path to the first byte: sub-millisecond is the goal, so fine buckets there.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 1.0)
LOOKUPS = ("hit", "miss", "expired", "foreign", "store_error", "no_conversation", "no_tenant")
CHOSEN = ("sticky", "hashed", "failover", "balanced")  # backends.Chosen
PREWARMS = ("sent", "done", "used", "wasted", "superseded", "busy", "failed", "skipped")
DEMOTIONS = ("demoted", "kept", "refused", "failed", "busy")  # router/demotions.py


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvshuttle_router_requests", "Client requests by outcome",
                                ["endpoint", "outcome"], registry=r)
        self.lookups = Counter("kvshuttle_router_handle_lookups",
                               "Handle lookups per turn: hit, miss, expired, foreign, store_error, no_conversation, "
                               "no_tenant", ["result"], registry=r)
        self.stored = Counter("kvshuttle_router_handles_stored", "Decode handles stored for a next turn", registry=r)
        self.invalid = Counter("kvshuttle_router_handles_invalid",
                               "Backend params dropped before storing (never forwarded)", ["reason"], registry=r)
        self.unlearned = Counter("kvshuttle_router_handles_unlearned",
                                 "Turns whose decode handle could not be learned", ["reason"], registry=r)
        self.expirations = Counter("kvshuttle_router_handle_expirations",
                                   "Handles that expired in the store (swept or found expired)", registry=r)
        self.evictions = Counter("kvshuttle_router_handle_evictions",
                                 "Handles dropped least recently used at the store's size bound", registry=r)
        self.live = Gauge("kvshuttle_router_live_handles", "Handles in the store (updated on scrape and sweep)",
                          registry=r)
        self.store_bytes = Gauge("kvshuttle_router_store_bytes",
                                 "Approximate serialized bytes of the memory store's handles (updated on scrape)",
                                 registry=r)
        self.held_bytes = Gauge("kvshuttle_router_held_body_bytes",
                                "Request bodies the router holds (reading, waiting, served), at their parsed estimate "
                                "(updated on scrape)", registry=r)
        self.waiting = Gauge("kvshuttle_router_waiting_turns",
                             "Turns waiting for an admission slot (updated on scrape)", registry=r)
        self.refusals = Counter("kvshuttle_router_refusals",
                                "Requests refused at admission: tenant_busy (429: the tenant's requests or bytes), "
                                "router_busy (503: all bodies' bytes), body_too_complex (413: its parsed estimate), "
                                "router_shutting_down (503)", ["kind"], registry=r)
        self.added_latency = Histogram("kvshuttle_router_added_latency_seconds",
                                       "Router's own time on a turn's path to its first byte (backend waits "
                                       "excluded)", buckets=LATENCY_BUCKETS, registry=r)
        self.backend_errors = Counter("kvshuttle_router_backend_errors", "Failed backend requests",
                                      ["role", "backend"], registry=r)
        self.retries = Counter("kvshuttle_router_retries", "Backend requests retried elsewhere (no handle)",
                               ["role"], registry=r)
        self.store_errors = Counter("kvshuttle_router_store_errors", "Store operations that failed", ["op"],
                                    registry=r)
        self.session_keys = Counter("kvshuttle_router_session_keys", "Turns whose conversation key came from each "
                                    "source (body:conversation_id or header:NAME; --session-key)", ["source"],
                                    registry=r)
        self.client_params_dropped = Counter("kvshuttle_router_client_params_dropped",
                                             "Client-supplied kv_transfer_params dropped (untrusted)", registry=r)
        self.client_timeouts = Counter("kvshuttle_router_client_timeouts",
                                       "Clients cut for slowness: body (request body not in time), write (a "
                                       "streamed answer not read in time)", ["kind"], registry=r)
        self.events_dropped = Counter("kvshuttle_router_stream_events_dropped",
                                      "Streamed events naming kv_transfer_params that were not JSON objects "
                                      "(dropped, never shown)", registry=r)
        self.releases = Counter("kvshuttle_router_releases",
                                "Decode retentions released (on DELETE, and after a decode-local turn)",
                                ["result"], registry=r)
        self.placements = Counter("kvshuttle_router_placements",
                                  "Turns by where they were computed: decode_local (on the decode holding the "
                                  "conversation), reverse_read (a prefill given the conversation's handle), "
                                  "recompute (a prefill or decode without one)", ["choice"], registry=r)
        self.read_tokens = Counter("kvshuttle_router_read_tokens",
                                   "Tokens kvshuttle's prefills reported reading back from a decode", registry=r)
        self.prewarms = Counter("kvshuttle_router_prewarms",
                                "Pre-warms: sent, done, used (the next turn went to the prefill warmed), wasted (it "
                                "went elsewhere, or never came), superseded (the next turn came first), busy (the "
                                "prefill had prewarm_max_in_flight already), failed, skipped (no answer text)",
                                ["result"], registry=r)
        self.demotions = Counter("kvshuttle_router_demotions",
                                 "Retentions the router asked a decode to demote into its host tier after an answer "
                                 "that ended with finish_reason stop (--demote-on-stop): demoted, kept (already in "
                                 "a tier, or no room there), refused (by name: no tier, an ended handle), failed "
                                 "(unreachable), busy (too many in flight, skipped)", ["outcome"], registry=r)
        self.affinities = Counter("kvshuttle_router_affinity",
                                  "Backend choices: sticky (the backend that served the conversation last), hashed "
                                  "(its rendezvous-hash home), failover (the next in hash order), balanced (no "
                                  "conversation, or affinity off)", ["role", "how"], registry=r)
        self.token_exacts = Counter("kvshuttle_router_token_exact",
                                    "Chat turns with --token-exact by how their prompt was made: exact (the kept "
                                    "ids plus the new messages), or why the router rendered it as usual",
                                    ["outcome"], registry=r)
        self.token_exact_keeps = Counter("kvshuttle_router_token_exact_kept",
                                         "Answers on the token-exact path: kept for the next turn, oversized, no_ids "
                                         "(the decode returned none), unusable (several choices, tool calls, "
                                         "reasoning), mismatch (the decode's prompt ids are not what this tokenizer "
                                         "and template give)", ["outcome"], registry=r)
        # Children bound once: a labels() lookup per request is measurable at 500 req/s.
        self.lookup = {name: self.lookups.labels(name) for name in LOOKUPS}
        self.placement = {name: self.placements.labels(name) for name in PLACEMENTS}
        self.prewarm = {name: self.prewarms.labels(name) for name in PREWARMS}
        self.demotion = {name: self.demotions.labels(name) for name in DEMOTIONS}
        self.token_exact = {name: self.token_exacts.labels(name) for name in OUTCOMES}
        self.token_exact_kept = {name: self.token_exact_keeps.labels(name) for name in KEEPS}
        self.affinity = {(role, how): self.affinities.labels(role, how) for role in ("prefill", "decode")
                         for how in CHOSEN}

    def render(self) -> bytes:
        return generate_latest(self.registry)
