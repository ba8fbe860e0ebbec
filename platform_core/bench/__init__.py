"""Benchmark instruments: offline throughput and latency, an online serving client, engine overhead.

``platform-core bench throughput|latency|serve`` (see ``platform_core/cli/bench.py``) and
``python -m platform_core.bench.overhead`` are the entry points; ``benchmarks/compare.py`` runs
side-by-side comparisons against other engines with the same workloads.
"""
