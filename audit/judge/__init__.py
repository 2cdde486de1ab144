"""Verdicts: per key from its bytes and the producer's records, then across keys, and merging shards."""
