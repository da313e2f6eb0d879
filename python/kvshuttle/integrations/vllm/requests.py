"""What the scheduler side reads off vLLM's request and block objects, without importing vLLM (so the
scheduler logic is testable anywhere; the end-to-end tests run it inside real engines)."""

from __future__ import annotations

from typing import Any

NORMAL_FINISHES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def finished_normally(request: Any) -> bool:
    """Stopped or length-capped (not aborted, not an error): only then does its KV mean anything later."""
    return getattr(request.status, "name", None) in NORMAL_FINISHES


def block_table(blocks: Any) -> list[int]:
    """The request's block ids (single KV-cache group: the connector does not declare SupportsHMA)."""
    groups = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if groups and isinstance(groups[0], (list, tuple)):
        groups = groups[0]
    return [int(b) for b in groups]
