"""Benchmarks reachable as ``kvtier bench <name>``: hit-rate replay, tier throughput, TTFT, overhead."""
