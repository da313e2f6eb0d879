"""What an engine's KV cache bytes mean (``compat.cache_dtype``), as every handle it issues names them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvshuttle.errors import LayoutError
from kvshuttle.integrations.vllm.compat import cache_dtype


def config(dtype: str, model_dtype: Any = "torch.bfloat16", **cache: Any) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=dtype, **cache),
                           model_config=SimpleNamespace(dtype=model_dtype))


@pytest.mark.parametrize(("dtype", "model_dtype", "named"), [
    ("auto", "torch.bfloat16", "bfloat16"),  # the model's own dtype
    ("auto", "torch.float16", "float16"),
    ("bfloat16", "torch.float16", "bfloat16"),
    ("fp8", "torch.bfloat16", "fp8_e4m3"),  # vLLM's alias on CUDA: an fp8 prefill reads an fp8_e4m3 decode
    ("fp8_e4m3", "torch.bfloat16", "fp8_e4m3"),
    ("fp8_e5m2", "torch.bfloat16", "fp8_e5m2"),
    ("fp8_ds_mla", "torch.bfloat16", "fp8_ds_mla"),  # FlashMLA's cells carry their own scales
])
def test_cache_dtypes_are_named_as_their_bytes_mean(dtype: str, model_dtype: str, named: str) -> None:
    assert cache_dtype(config(dtype, model_dtype)) == named


@pytest.mark.parametrize("dtype", ["fp8_per_token_head", "int8_per_token_head", "nvfp4", "turboquant_k8v4",
                                   "fp8_inc"])
def test_caches_whose_scales_kvshuttle_does_not_carry_are_refused_at_start_up(dtype: str) -> None:
    with pytest.raises(LayoutError, match=dtype):
        cache_dtype(config(dtype))


def test_layers_that_skip_quantization_are_refused() -> None:
    with pytest.raises(LayoutError, match="skip"):
        cache_dtype(config("fp8", kv_cache_dtype_skip_layers=["0"]))
