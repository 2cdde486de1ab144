"""Every way bytes arrive: lease reads (`lease`, through `batch_get_into`), lease-free raw reads of
every replica (`peek`, with `engine` and `descriptors`) into the registered `buffers`, and lease-free
reads of disk-only keys from a holder's offload files on its host (`disk`, with `offload_index` over
`buckets` and `key_files`); optionally
paced by `throttle`; `confirm` re-reads a finding, `replicas` compares the replicas of one key."""

from audit.readers.confirm import Confirmation, KeyRead, apply_confirmation
from audit.readers.peek import PeekReader
from audit.readers.replicas import judge_replicas

__all__ = ["Confirmation", "KeyRead", "PeekReader", "apply_confirmation", "judge_replicas"]
