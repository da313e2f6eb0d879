"""``kvshuttle demo``: a decode and a prefill process walking every reuse case over real NIXL, every byte checked."""
