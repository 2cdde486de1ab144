"""An embedded Mooncake cluster on loopback: one master and N storage holders.

Used by `mooncake-audit demo`, the test fixtures and the benchmarks. Every process is started
on 127.0.0.1 with free ports, and torn down by PID (also on exceptions and Ctrl-C, through the
context manager); the embedded metadata server and admin port are asked to bind to loopback. Its
logs (and the holders' SSD tiers) go to `log_dir`, or to a temporary directory of its own, removed
when the cluster stops unless it failed (its error names the directory).
With `offload`, the holders also keep an SSD tier (Mooncake's bucket backend, or with `backend`
its file-per-key one; eager: every put reaches the disk about a second later, or with
`offload_on_evict` only when memory evicts it), so a test can have memory-only, disk-only and both.
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from audit.connection import AdminClient
from audit.sources.listing import TIERS

OFFLOAD_STAGING_BYTES = 64 << 20  # a holder's buffer for values on their way to and from its disk
FILE_CAPACITY = "master_total_file_capacity_bytes"  # grows as each offloading holder mounts its disk
MASTER_PORT_TRIES = 3  # fresh ports each try: a port probed free can be taken before the master binds it
BACKENDS = {"bucket": "bucket_storage_backend", "file_per_key": "file_per_key_storage_backend"}  # SSD-tier formats


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
    offload_dir: Path | None = None  # where it writes its SSD tier (`<id>.bucket` and `.meta`, or key files), if any


@dataclass
class LocalCluster:
    """Master + holders on loopback. Use as a context manager; `stop()` is idempotent."""

    holders: int = 1
    segment_mb: int = 512
    lease_ttl_ms: int | None = None
    client_ttl_s: int | None = None
    tenants: tuple[str, ...] = ()  # a multi-tenant master: these tenants and the default, 1 GB of quota each
    offload: bool = False  # holders offload every put to a directory of their own (bucket backend, eager)
    promote_after: int | None = None  # with offload: a disk-only key read this many times is copied back to memory
    bucket_keys: int = 1  # with offload: keys per bucket file (Mooncake's 500 would keep a test's keys off the disk)
    backend: str = "bucket"  # with offload: the holders' SSD-tier format, a key of BACKENDS
    offload_on_evict: bool = False  # with offload: a value reaches the disk when memory evicts it, not after its put
    log_dir: Path | None = None
    metadata_port: int = field(default_factory=free_port)
    rpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    master: subprocess.Popen | None = None
    running_holders: list[Holder] = field(default_factory=list)
    _own_log_dir: bool = field(default=False, repr=False)  # made here: removed at stop, unless kept for a failure
    _failed: bool = field(default=False, repr=False)

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
            self.log_dir, self._own_log_dir = Path(tempfile.mkdtemp(prefix="mooncake-cluster-")), True
        self._start_master(timeout_s)
        for _ in range(self.holders):
            self.add_holder(timeout_s)

    def _start_master(self, timeout_s: float) -> None:
        """The master, on fresh ports again where another process bound one of its ports between
        `free_port`'s probe and the master's bind (a busy host's ephemeral ports: seen in CI)."""
        for attempt in range(1, MASTER_PORT_TRIES + 1):
            self.master = self._spawn(self._master_args(), "master")
            try:
                self._wait(lambda: _http_ok(f"{self.admin_url}/health") is not None, "master /health", timeout_s)
                return
            except ClusterError:
                if attempt == MASTER_PORT_TRIES or not self._master_lost_a_port():
                    raise
            self._failed = False  # (a port lost is not a failure: tried again)
            _terminate(self.master, signal.SIGTERM)
            (self.log_dir / "master.log").rename(self.log_dir / f"master-lost-a-port-{attempt}.log")
            self.metadata_port, self.rpc_port, self.admin_port = free_port(), free_port(), free_port()

    def _master_lost_a_port(self) -> bool:
        assert self.log_dir is not None
        log = (self.log_dir / "master.log").read_bytes()
        return b"Address already in use" in log or b"Failed to start HTTP metadata server" in log

    def _master_args(self) -> list[str]:
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
        if self.offload:
            args.append("--enable_offload=true")
        if self.offload_on_evict:
            args.append("--offload_on_evict=true")
        if self.promote_after is not None:
            args += ["--promotion_on_hit=true", f"--promotion_admission_threshold={self.promote_after}"]
        if self.tenants:  # every tenant needs a policy, the default included: a put into one without fails
            assert self.log_dir is not None
            quotas = self.log_dir / "tenant-quotas.yaml"
            quotas.write_text("version: 1\ntenants:\n" + "".join(
                f"  - name: {name}\n    quota: 1GB\n" for name in ("default", *self.tenants)))
            args += ["--enable_multi_tenants=true", "--tenant_quota_connector_type=file",
                     f"--tenant_quota_connector_uri={quotas}"]
        return args

    def add_holder(self, timeout_s: float = 30.0, offload: bool | None = None) -> Holder:
        """A holder more; `offload` (the cluster's `offload` unless given): whether it keeps an SSD
        tier, so that one cluster can hold keys that never reach a disk beside keys that do."""
        offload_dir = None
        if self.offload if offload is None else offload:
            assert self.log_dir is not None
            offload_dir = self.log_dir / f"offload-{free_port()}"
            offload_dir.mkdir()
        return self._start_holder(offload_dir, timeout_s)

    def restart_holder(self, holder: Holder, timeout_s: float = 30.0) -> Holder:
        """Stop `holder` (SIGTERM) and start a new one on its offload directory, as an operator's
        restart does: at start-up it registers with the master every key its `.meta` files list."""
        self.kill_holder(holder, signal.SIGTERM)
        self._wait(lambda: holder.segment not in self.segments(), f"the master to drop holder {holder.port}", timeout_s)
        return self._start_holder(holder.offload_dir, timeout_s)

    def _start_holder(self, offload_dir: Path | None, timeout_s: float) -> Holder:
        port = free_port()
        before = self.segments()
        args = [
            _binary("mooncake_client"),
            "--host=127.0.0.1",
            f"--port={port}",
            f"--global_segment_size={self.segment_mb}MB",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_url}",
            "--protocol=tcp",
        ]
        if offload_dir is not None:
            args.append("--enable_offload=true")
            admin = AdminClient(self.admin_url)
            disks_before = admin.metric(FILE_CAPACITY) or 0
        process = self._spawn(args, f"holder-{port}", self._offload_env(offload_dir))
        holder = Holder(port, process, offload_dir=offload_dir)
        self.running_holders.append(holder)
        self._wait(lambda: self.segments() - before, f"segment of holder {port}", timeout_s)
        holder.segment = min(self.segments() - before)
        if offload_dir is not None:  # its disk mounts a second or two after its memory: puts before that never reach it
            self._wait(lambda: (admin.metric(FILE_CAPACITY) or 0) > disks_before, f"disk of holder {port}", timeout_s)
        return holder

    def _offload_env(self, offload_dir: Path | None) -> dict[str, str] | None:
        """A holder's SSD-tier settings (FACTS §11): small buckets, so that a handful of test keys
        reach the disk (a bucket waits for its keys or 256 MiB); heartbeats every second; a staging
        buffer and a disk quota sized to a test, not to the defaults' 1.25 GB and 90% of the disk."""
        if offload_dir is None:
            return None
        return {**os.environ,
                "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(offload_dir),
                "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": BACKENDS[self.backend],
                "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(self.bucket_keys),
                "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
                "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(OFFLOAD_STAGING_BYTES),
                "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(8 * self.segment_mb << 20)}

    def tiers(self, names: Iterable[str]) -> dict[str, set[str]]:
        """Per key the master knows, the tiers holding a replica of it (`memory`, `local_disk`, ...),
        asked lease-free (`/batch_query_keys`)."""
        return {name: {tier for field, tier in TIERS.items() if answer.get(field)}
                for name, answer in AdminClient(self.admin_url).query(names) if answer.get("ok")}

    def wait_held(self, names: Iterable[str], tier: str, timeout_s: float = 30.0) -> None:
        """Until every key of `names` has a replica in `tier` (`local_disk`: offloaded; `memory`:
        promoted back). Both run on the holders' heartbeats: about a second. A key evicted from
        memory before it reached the disk is lost, so a test that fills a segment waits for each
        part to be offloaded before it puts the next."""
        names = list(names)
        self._wait_tiers(names, lambda tiers: sum(tier in held for held in tiers.values()),
                         len(names), f"with a {tier} replica", timeout_s)

    def wait_disk_only(self, names: Iterable[str], count: int, timeout_s: float = 30.0) -> set[str]:
        """The keys of `names` held on disk only, once there are at least `count` of them (eviction
        runs on the master's own schedule: seconds, not milliseconds)."""
        names = list(names)
        tiers = self._wait_tiers(names, lambda tiers: sum(held == {"local_disk"} for held in tiers.values()),
                                 count, "disk-only", timeout_s)
        return {name for name, held in tiers.items() if held == {"local_disk"}}

    def _wait_tiers(self, names: list[str], counted, count: int, what: str, timeout_s: float) -> dict[str, set[str]]:
        deadline = time.monotonic() + timeout_s
        while (found := counted(tiers := self.tiers(names))) < count:
            if time.monotonic() > deadline:
                raise self._failure(f"{found} of {len(names)} keys {what} after {timeout_s} s, not {count}; "
                                   f"logs in {self.log_dir}")
            time.sleep(0.1)
        return tiers

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
        if self._own_log_dir and not self._failed and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self._own_log_dir = False

    def _spawn(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        assert self.log_dir is not None
        log = open(self.log_dir / f"{name}.log", "wb")
        # A new session keeps the daemons out of the terminal's Ctrl-C: we stop them ourselves.
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)

    def _failure(self, message: str) -> ClusterError:
        """The error to raise; the logs it names are kept."""
        self._failed = True
        return ClusterError(message)

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for process in [self.master, *(h.process for h in self.running_holders)]:
                if process is not None and process.poll() is not None:
                    raise self._failure(f"{Path(process.args[0]).name} exited ({process.returncode}) "
                                       f"while waiting for {what}; logs in {self.log_dir}")
            if time.monotonic() > deadline:
                raise self._failure(f"timed out waiting for {what}; logs in {self.log_dir}")
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
