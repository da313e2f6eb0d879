"""The router's named errors; each derives from :class:`kvshuttle.errors.KVShuttleError`.

Only configuration and store failures are errors: a backend or store failure during a request degrades to a
plain (recompute) turn and is counted, never raised to the client while a backend that can answer is up.
"""

from __future__ import annotations

from ..errors import KVShuttleError


class RouterError(KVShuttleError):
    """Base class of the router's errors."""


class RouterConfigError(RouterError, ValueError):
    """A router setting is malformed or inconsistent (a backend URL, the TTL pair, an API-key file): fix it."""


class StoreError(RouterError, RuntimeError):
    """The handle store could not answer (Redis down or slow): the turn goes on without a handle."""
