"""Tests of the benchmarks' shared harness, benchmarks/timing.py."""
