"""Decoder benchmarks: ratios measured side by side in one run."""
