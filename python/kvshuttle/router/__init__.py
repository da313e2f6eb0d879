"""The multi-turn router: an OpenAI-compatible proxy in front of prefill and decode vLLM servers that carries
each conversation's decode handle (``kv_transfer_params``) to its next turn's prefill.

``kvshuttle router --prefill URL --decode URL,kv=HOST:PORT`` runs it; :class:`Router` embeds it. Needs the
``router`` extra (aiohttp, redis, prometheus-client); pyzmq (the ``transfer`` extra) for streamed turns with
kvshuttle's connector. See ``README.md`` ("Multi-turn router") and ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

from .config import BackendSpec, RouterConfig, load_api_keys, parse_backend
from .errors import RouterConfigError, RouterError, StoreError
from .handles import FIRST_TURN_PARAMS, store_key
from .proxy import Router
from .store import HandleStore, Lookup, MemoryStore, RedisStore, StoredHandle

__all__ = [
    "FIRST_TURN_PARAMS",
    "BackendSpec",
    "HandleStore",
    "Lookup",
    "MemoryStore",
    "RedisStore",
    "Router",
    "RouterConfig",
    "RouterConfigError",
    "RouterError",
    "StoreError",
    "StoredHandle",
    "load_api_keys",
    "parse_backend",
    "store_key",
]
