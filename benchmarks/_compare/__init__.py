"""The parts of benchmarks/compare.py: adapters, writer processes, latency, report, chart."""
