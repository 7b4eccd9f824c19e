"""Benchmarks behind the ``leanprop bench`` command."""
