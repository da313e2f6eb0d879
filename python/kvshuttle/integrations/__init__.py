"""Entry points into serving frameworks: :mod:`kvshuttle.integrations.vllm` (a vLLM KV connector)."""
