"""Benchmarks: `python -m tools.bench NAME` runs tools/bench/NAME.py (ratios against a baseline measured in the same run)."""
