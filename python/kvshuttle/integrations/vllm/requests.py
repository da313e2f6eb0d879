"""What the scheduler side reads off vLLM's request and block objects, without importing vLLM (so the
scheduler logic is testable anywhere; the end-to-end tests run it inside real engines)."""

from __future__ import annotations

from typing import Any

NORMAL_FINISHES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def finished_normally(request: Any) -> bool:
    """Stopped or length-capped (not aborted, not an error): only then does its KV mean anything later."""
    return getattr(request.status, "name", None) in NORMAL_FINISHES


def unsupported(request: Any) -> str:
    """Why ``request``'s token ids do not determine its KV ("" when they do), so that block digests over them
    could vouch for the wrong KV: prompt embeddings (no token ids at all), multimodal inputs (placeholder
    tokens stand for different images) or a LoRA adapter (other weights). Such requests neither read nor keep KV;
    they recompute. (A cache salt, a tenant's isolated prefix cache, is served: it goes into every block digest,
    so its handles verify only prompts under the same salt.)"""
    if getattr(request, "prompt_token_ids", None) is None or getattr(request, "prompt_embeds", None) is not None:
        return "its prompt is embeddings, not token ids"
    if getattr(request, "mm_features", None):
        return "it has multimodal inputs"
    if getattr(request, "lora_request", None) is not None:
        return "it uses a LoRA adapter"
    return ""


def block_table(blocks: Any) -> list[int]:
    """The request's block ids (single KV-cache group: the connector does not declare SupportsHMA)."""
    groups = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if groups and isinstance(groups[0], (list, tuple)):
        groups = groups[0]
    return [int(b) for b in groups]
