"""A vLLM worker extension for the e2e tests: digests of the KV bytes a worker holds for a request's blocks.

An engine started with ``worker_extension_cls=WORKER_EXTENSION`` (an ``LLM(...)`` argument, see
:func:`.engines.pd_pair`) answers ``VllmEngine.rpc("kvshuttle_token_digests", block_ids, num_tokens)``: vLLM's
``collective_rpc`` by method name, so no pickled code travels, one answer per tensor-parallel rank. A test compares
the digests of the blocks a read filled with those of the blocks it read from: byte equality of what moved,
whatever the model's numerics.

Tokens are axis 2 of vLLM 0.32's per-layer views ``[N, H, B, C]``: a token's row is exactly its KV for MLA
(``H = 1``, C the latent) and FlashAttention; CPU_ATTN stores K column-major inside a block, so there only a full
block's digests mean its bytes (compare whole blocks). torch is imported by vLLM's worker, never here at import.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: The ``worker_extension_cls`` value that adds :class:`KVProbe`'s method to vLLM's worker.
WORKER_EXTENSION = "kvshuttle.bench.e2e.kv_probe.KVProbe"


class KVProbe:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self.model_runner`` is the worker's."""

    model_runner: Any

    def kvshuttle_token_digests(self, block_ids: list[int], num_tokens: int) -> list[str]:
        """One hex digest per token of the first ``num_tokens`` tokens held in ``block_ids`` (token order): the
        bytes of that token's slot in every layer (layers in vLLM's order)."""
        layers = self.model_runner.kv_caches  # per-layer [N, H, B, C] views, bound in layer order
        block_size = int(layers[0].shape[2])
        digests = []
        for t in range(num_tokens):
            h = hashlib.blake2b(digest_size=16)
            block, slot = int(block_ids[t // block_size]), t % block_size
            for layer in layers:
                h.update(layer[block, :, slot].contiguous().view(-1).view(dtype=_uint8()).numpy().tobytes())
            digests.append(h.hexdigest())
        return digests


def _uint8() -> Any:
    import torch

    return torch.uint8
