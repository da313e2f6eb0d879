"""Benchmarks behind ``kvshuttle bench`` (pack, plan, transfer, policy, retention), one JSON schema for all
(:mod:`.schema`), shared interleaved timing (:mod:`.timing`), and the policy's cost inputs read from the
transfer bench's JSON (:mod:`.cost_inputs`)."""
