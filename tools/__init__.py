"""Repository tools: benchmarks (tools/bench) and conversions; not part of the installed package."""
