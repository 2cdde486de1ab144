"""Benchmarks of mooncake-audit: `python -m benchmarks.run [--quick]` (docs/benchmarks.md)."""
