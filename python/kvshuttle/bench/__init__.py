"""Benchmarks behind ``kvshuttle bench``."""
