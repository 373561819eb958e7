"""Benchmarks; results go to BENCHMARKS.md."""
