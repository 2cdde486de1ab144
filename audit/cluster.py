"""An embedded Mooncake cluster on loopback: one master and N storage holders.

Used by `mooncake-audit demo`, the test fixtures and the benchmarks. Every process is started
on 127.0.0.1 with free ports, and torn down by PID (also on exceptions and Ctrl-C, through the
context manager); the embedded metadata server and admin port are asked to bind to loopback.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class ClusterError(RuntimeError):
    """The embedded cluster could not be started."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _binary(name: str) -> str:
    """The Mooncake daemon shipped by the installed wheel (beside the interpreter, or on PATH)."""
    import sys

    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ClusterError(f"{name} not found: install mooncake-transfer-engine-non-cuda")
    return found


def _http_ok(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.read()
    except OSError:
        return None


@dataclass
class Holder:
    """A `mooncake_client` daemon that mounts one memory segment.

    `segment` is the transfer endpoint it registered (`host:port`, a port the daemon picks itself):
    replica descriptors name it as `transport_endpoint_`.
    """

    port: int
    process: subprocess.Popen
    segment: str = ""


@dataclass
class LocalCluster:
    """Master + holders on loopback. Use as a context manager; `stop()` is idempotent."""

    holders: int = 1
    segment_mb: int = 512
    lease_ttl_ms: int | None = None
    client_ttl_s: int | None = None
    tenants: tuple[str, ...] = ()  # a multi-tenant master: these tenants and the default, 1 GB of quota each
    log_dir: Path | None = None
    metadata_port: int = field(default_factory=free_port)
    rpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    master: subprocess.Popen | None = None
    running_holders: list[Holder] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> None:
        # Transfer engines (the daemons' and this process's clients) otherwise listen on the
        # first non-loopback interface; an embedded cluster stays on 127.0.0.1.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        atexit.register(self.stop)  # a safety net: daemons never outlive the process that started them
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="mooncake-cluster-"))
        args = [
            _binary("mooncake_master"),
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.admin_port}",
            "--metrics_host=127.0.0.1",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.client_ttl_s is not None:
            args.append(f"--client_ttl={self.client_ttl_s}")
        if self.tenants:  # every tenant needs a policy, the default included: a put into one without fails
            quotas = self.log_dir / "tenant-quotas.yaml"
            quotas.write_text("version: 1\ntenants:\n" + "".join(
                f"  - name: {name}\n    quota: 1GB\n" for name in ("default", *self.tenants)))
            args += ["--enable_multi_tenants=true", "--tenant_quota_connector_type=file",
                     f"--tenant_quota_connector_uri={quotas}"]
        self.master = self._spawn(args, "master")
        self._wait(lambda: _http_ok(f"{self.admin_url}/health") is not None, "master /health", timeout_s)
        for _ in range(self.holders):
            self.add_holder(timeout_s)

    def add_holder(self, timeout_s: float = 30.0) -> Holder:
        port = free_port()
        before = self.segments()
        process = self._spawn(
            [
                _binary("mooncake_client"),
                "--host=127.0.0.1",
                f"--port={port}",
                f"--global_segment_size={self.segment_mb}MB",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_url}",
                "--protocol=tcp",
            ],
            f"holder-{port}",
        )
        holder = Holder(port, process)
        self.running_holders.append(holder)
        self._wait(lambda: self.segments() - before, f"segment of holder {port}", timeout_s)
        holder.segment = min(self.segments() - before)
        return holder

    def segments(self) -> set[str]:
        body = _http_ok(f"{self.admin_url}/get_all_segments") or b""
        return {line.strip() for line in body.decode(errors="replace").splitlines() if line.strip()}

    def kill_holder(self, holder: Holder, sig: int = signal.SIGKILL) -> None:
        """Stop one holder abruptly (fault injection)."""
        _terminate(holder.process, sig)
        self.running_holders.remove(holder)

    def stop(self) -> None:
        for holder in self.running_holders:
            _terminate(holder.process, signal.SIGTERM)
        self.running_holders.clear()
        if self.master is not None:
            _terminate(self.master, signal.SIGTERM)
            self.master = None

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        assert self.log_dir is not None
        log = open(self.log_dir / f"{name}.log", "wb")
        # A new session keeps the daemons out of the terminal's Ctrl-C: we stop them ourselves.
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for process in [self.master, *(h.process for h in self.running_holders)]:
                if process is not None and process.poll() is not None:
                    raise ClusterError(f"{Path(process.args[0]).name} exited ({process.returncode}) "
                                       f"while waiting for {what}; logs in {self.log_dir}")
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; logs in {self.log_dir}")
            time.sleep(0.05)


def _terminate(process: subprocess.Popen, sig: int, grace_s: float = 10.0) -> None:
    """Signal, wait, then SIGKILL; a process that already exited is simply reaped."""
    if process.poll() is not None:
        return
    try:
        process.send_signal(sig)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
