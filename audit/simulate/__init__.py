"""The producer simulator: a labelled vLLM #53084 workload (real Mamba states, align-mode sparse
block tables, null-backed keys) published into any Mooncake cluster. See ``workload.py``."""

from .align import REPORTED_NULL_BOUNDARIES
from .configs import MAMBA_130M, TINY_MAMBA1, TINY_MAMBA2
from .labels import Label, expected_verdicts, read_labels
from .workload import SimulationOptions, SimulationResult, Workload, WorkloadEntry, build_workload, simulate

__all__ = [
    "MAMBA_130M",
    "REPORTED_NULL_BOUNDARIES",
    "TINY_MAMBA1",
    "TINY_MAMBA2",
    "Label",
    "SimulationOptions",
    "SimulationResult",
    "Workload",
    "WorkloadEntry",
    "build_workload",
    "expected_verdicts",
    "read_labels",
    "simulate",
]
