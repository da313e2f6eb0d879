"""Field names of ``kv_transfer_params`` that more than one floor writes or reads, defined once.

Stdlib only, imported by nothing heavy: the router (no pyzmq, no NIXL) and the transfer engine's handle board
name the same field from here.
"""

from __future__ import annotations

PUBLISH_KEY = "kvshuttle_publish_key"  # the field a router adds to a decode request's kv_transfer_params
