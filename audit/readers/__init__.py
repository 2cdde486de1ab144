"""Read modes beyond `audit.fetch.LeaseReader`: lease-free reads of every replica (`peek`)."""

from audit.readers.confirm import Confirmation, apply_confirmation
from audit.readers.peek import KeyRead, PeekReader
from audit.readers.replicas import judge_replicas

__all__ = ["Confirmation", "KeyRead", "PeekReader", "apply_confirmation", "judge_replicas"]
