"""Benchmark harness for dcp_datastates ; see docs/benchmarks.md."""
