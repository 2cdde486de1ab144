"""Key names, parsed into report fields: every producer's scheme (`audit.producers`), and the key
vLLM's connector publishes. A key that matches no scheme is `opaque`: it is still audited by its bytes."""

from audit.producers import parse_key, split_stem
from audit.producers.vllm import vllm_key

__all__ = ["parse_key", "split_stem", "vllm_key"]
