"""Fixtures: a real Mooncake cluster (master + holders) on loopback, torn down by PID.

Only the GPU is faked: without CUDA, Triton kernels run under the interpreter, which must be
switched on before any kernel module is imported. On a GPU host they are compiled for it (set
TRITON_INTERPRET=1 to run the interpreted path there too).
"""

from __future__ import annotations

import itertools
import os


def _gpu_host() -> bool:
    from audit.run.device import _gpu_visible, _mooncake_has_cuda

    return _mooncake_has_cuda() and _gpu_visible()


if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if _gpu_host() else "1"
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import pytest  # noqa: E402

from audit.cluster import LocalCluster  # noqa: E402
from audit.connection import Settings  # noqa: E402
from audit.workload import Publisher  # noqa: E402

_namespaces = itertools.count()


@pytest.fixture(scope="session")
def cluster():
    with LocalCluster(holders=1, segment_mb=512) as running:
        yield running


def settings_for(cluster: LocalCluster) -> Settings:
    return Settings(master=cluster.master_address, metadata=cluster.metadata_url, admin=cluster.admin_url,
                    local_hostname="127.0.0.1")


@pytest.fixture(scope="session")
def settings(cluster) -> Settings:
    return settings_for(cluster)


@pytest.fixture(scope="session")
def publisher(settings):
    producer = Publisher(settings)
    yield producer
    producer.close()


@pytest.fixture
def namespace() -> str:
    """A key prefix of this test's own, so tests sharing the cluster never see each other's keys."""
    return f"t{next(_namespaces):03d}-{os.getpid()}/"


@pytest.fixture
def cli_args(cluster) -> list[str]:
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url,
            "--admin", cluster.admin_url, "--local-hostname", "127.0.0.1"]
