"""Where fetched values land and which checker reads them: `--device` and `--checker`.

auto: cpu for lease-free peek reads (they land in host memory); otherwise cuda when the CUDA build of
the Mooncake client is installed (the non-CUDA build cannot register GPU memory) *and* torch sees a
GPU, else cpu. The wheel is checked first: it is a metadata lookup, while importing torch costs
seconds that a cron run on a CPU host should never pay. The checker follows the device unless asked:
numpy on cpu, triton on cuda; triton on cpu runs the kernel under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from audit.errors import AuditError
from audit.readers.buffers import CudaBuffer, RegisteredBuffer

DEVICES = ("auto", "cpu", "cuda")
CHECKERS = ("numpy", "triton")


def _mooncake_has_cuda() -> bool:
    try:
        metadata.distribution("mooncake-transfer-engine")
        return True
    except metadata.PackageNotFoundError:
        return False


def _gpu_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True)
class Placement:
    device: str          # "cpu" or "cuda"
    checker_name: str    # "numpy" or "triton"

    @property
    def buffer_type(self):
        return CudaBuffer if self.device == "cuda" else RegisteredBuffer

    def checker(self):
        if self.checker_name == "numpy":
            from audit.checks.host import HostChecker

            return HostChecker()
        try:
            from audit.checks.triton import TritonChecker

            return TritonChecker(self.device)
        except ImportError as error:
            raise AuditError(f"--checker triton needs torch and triton ({error}); "
                             f"pip install 'mooncake-audit[kernels]'") from None


def resolve_placement(device: str = "auto", checker: str | None = None, read_mode: str = "lease") -> Placement:
    if device not in DEVICES:
        raise AuditError(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    if checker is not None and checker not in CHECKERS:
        raise AuditError(f"--checker must be one of {', '.join(CHECKERS)}, not {checker!r}")
    if device == "auto":
        device = "cuda" if read_mode == "lease" and _mooncake_has_cuda() and _gpu_visible() else "cpu"
    elif device == "cuda":
        if read_mode == "peek":
            raise AuditError("--read-mode peek reads into host memory: use it with --device cpu (or auto)")
        if not _gpu_visible():
            raise AuditError("--device cuda: torch sees no CUDA GPU")
        if not _mooncake_has_cuda():
            raise AuditError("--device cuda needs the CUDA build of the Mooncake client "
                             "(pip install 'mooncake-audit[cuda]'; uninstall mooncake-transfer-engine-non-cuda)")
    checker = checker or ("triton" if device == "cuda" else "numpy")
    if device == "cuda" and checker == "numpy":
        raise AuditError("--checker numpy reads host memory: use it with --device cpu")
    return Placement(device, checker)
