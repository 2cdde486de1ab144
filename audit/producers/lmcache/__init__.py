"""LMCache: its keys (`keys`), its values' header (`header`) and checksum frame (`checksum_frame`),
and what they say about a value (`values`), behind the producer interface (`producer`)."""
