"""Benchmarks of single stages at a run config's exact shapes (throughput, FLOP/s, memory, compile time)."""
