"""End-to-end harness against real vLLM engines (CPU): a tiny random Llama, engines in killable process groups.

``tiny_model`` builds the model and tokenizer locally (no download); ``engines`` runs one offline ``vllm.LLM``
per child process, parameterised by a ``KVTransferConfig`` dict, and ``conversation`` drives a multi-turn
prefill/decode conversation the way vLLM's multi-turn proxy does. Nothing here imports vllm, torch or
transformers at import time: they are needed only inside the engine processes and the model builder.
"""
