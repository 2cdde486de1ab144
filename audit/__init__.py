"""mooncake-audit: byte-level audit of the values published into Mooncake Store."""

__version__ = "0.1.0"
