"""Checks over fetched bytes: digests, zero flags and (per region) NaN/Inf counts."""
