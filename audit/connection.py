"""Where the cluster is and how to talk to it: settings, the admin HTTP client, the store client.

Settings come from flags, then environment variables (both resolved by the CLI), then the Mooncake
JSON config that vLLM's connector uses (`MOONCAKE_CONFIG_PATH`), then defaults.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import socket
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson

from audit.errors import AuditError
from audit.listeners import accept_shortened


DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_METADATA_PORT = 8080
DEFAULT_ADMIN_PORT = 9003


@dataclass(frozen=True)
class Settings:
    master: str
    metadata: str
    admin: str
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str | None = None

    @classmethod
    def resolve(cls, *, master: str | None = None, metadata: str | None = None, admin: str | None = None,
                protocol: str | None = None, device_name: str | None = None,
                local_hostname: str | None = None, config: Path | None = None) -> Settings:
        """Explicit values win; the config file fills what is missing; defaults fill the rest."""
        file = read_mooncake_config(config) if config else {}
        master = master or file.get("master_server_address") or DEFAULT_MASTER
        host = master.rsplit(":", 1)[0]
        return cls(
            master=master,
            metadata=metadata or file.get("metadata_server") or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata",
            admin=(admin or f"http://{host}:{DEFAULT_ADMIN_PORT}").rstrip("/"),
            protocol=protocol or file.get("protocol") or "tcp",
            device_name=device_name if device_name is not None else file.get("device_name", ""),
            local_hostname=local_hostname or file.get("local_hostname"),
        )


def read_mooncake_config(path: Path) -> dict:
    """The JSON file vLLM's MooncakeStoreConnector reads (fields: master_server_address, ...)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise AuditError(f"cannot read config {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise AuditError(f"config {path} is not JSON: line {error.lineno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise AuditError(f"config {path} must hold a JSON object")
    return data


QUERY_KEYS_PER_CALL = 1000
QUERY_URL_BUDGET = 48 * 1024  # bytes of percent-encoded keys per `/batch_query_keys` call
_PLAIN_KEYS = re.compile(r"[A-Za-z0-9_.~@:,-]*").fullmatch  # comma-joined keys percent-encoding leaves as they are


def _encoded(key: str) -> str:
    """Percent-encoded for the query string; '@' and ':' (in every vLLM key) stay as they are."""
    return urllib.parse.quote(key.encode("utf-8", "surrogateescape"), safe="@:")


def _query_strings(keys: list[str]) -> Iterator[str]:
    """`keys` comma-joined and percent-encoded, in pieces of at most QUERY_URL_BUDGET bytes. Keys
    that need no encoding (every vLLM key) are joined as they are: one pattern match for the lot."""
    joined = ",".join(keys)
    if _PLAIN_KEYS(joined):
        yield joined
        return
    piece: list[str] = []
    budget = 0
    for encoded in map(_encoded, keys):
        if piece and budget + len(encoded) + 1 > QUERY_URL_BUDGET:
            yield ",".join(piece)
            piece, budget = [], 0
        piece.append(encoded)
        budget += len(encoded) + 1
    yield ",".join(piece)


def _chunked_queries(keys: Iterable[str]) -> Iterator[str]:
    """`keys` as query strings of at most QUERY_KEYS_PER_CALL keys and QUERY_URL_BUDGET bytes each."""
    chunk: list[str] = []
    budget = 0  # the chunk's length before encoding: encoding only lengthens it
    for key in keys:
        if chunk and (len(chunk) >= QUERY_KEYS_PER_CALL or budget + len(key) + 1 > QUERY_URL_BUDGET):
            yield from _query_strings(chunk)
            chunk, budget = [], 0
        chunk.append(key)
        budget += len(key) + 1
    if chunk:
        yield from _query_strings(chunk)


class AdminClient:
    """The master's admin HTTP port: listing and lease-free queries. Never its destructive routes.

    One keep-alive connection per thread (a listing makes thousands of calls; the peek reader asks
    from the fetch thread while the main thread checks), and one more thread that asks a query's
    next call while the caller parses the last answer (`_bodies_ahead`).
    """

    def __init__(self, base_url: str, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        parsed = urllib.parse.urlsplit(self.base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise AuditError(f"--admin must be an http(s) URL, not {base_url!r}")
        self._parsed = parsed
        self._local = threading.local()
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="admin-ahead")  # its thread starts when used

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
            connection = kind(self._parsed.hostname, self._parsed.port, timeout=self.timeout_s)
            self._local.connection = connection
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None

    def _request(self, path: str, accepted: tuple[int, ...]) -> tuple[int, bytes]:
        connection = self._connection()
        connection.request("GET", self._parsed.path + path)  # reads only (docs/coverage.md)
        response = connection.getresponse()
        body = response.read()
        if response.status not in accepted:
            raise AuditError(f"admin {self.base_url} answered {response.status} to {path.split('?')[0]}")
        return response.status, body

    def _get_answer(self, path: str, accepted: tuple[int, ...] = (200,)) -> tuple[int, bytes]:
        try:
            return self._request(path, accepted)
        except (OSError, http.client.HTTPException):
            self._drop_connection()  # a kept-alive connection the server closed meanwhile: once more
        try:
            return self._request(path, accepted)
        except (OSError, http.client.HTTPException) as error:
            self._drop_connection()
            raise AuditError(f"admin {self.base_url} unreachable: {error or type(error).__name__}") from None

    def _get(self, path: str) -> bytes:
        return self._get_answer(path)[1]

    def health(self) -> None:
        self._get("/health")

    def key_count(self) -> int | None:
        """`master_key_count` from `/metrics`: every key of every tenant, a put in flight included
        (counted from its start); None when the master does not report it."""
        return self.metric("master_key_count")

    def metric(self, wanted: str) -> int | None:
        """One unlabelled counter or gauge of `/metrics`; None when the master does not report it."""
        for line in self._get("/metrics").decode(errors="replace").splitlines():
            name, _, value = line.partition(" ")
            if name == wanted:
                try:
                    return int(float(value))
                except ValueError:
                    return None
        return None

    def tenant_quotas(self) -> list[dict] | None:
        """`/api/v1/tenant_quotas`: one row per tenant (`tenant_id`, `charged_bytes`, ...) on a
        multi-tenant master; None when tenants are off (409) or the master predates them (404)."""
        status, body = self._get_answer("/api/v1/tenant_quotas", accepted=(200, 404, 409))
        if status != 200:
            return None
        try:
            rows = json.loads(body).get("data")
        except (json.JSONDecodeError, AttributeError):
            raise AuditError(f"admin {self.base_url} sent a malformed answer to /api/v1/tenant_quotas") from None
        if not isinstance(rows, list):
            raise AuditError(f"admin {self.base_url} sent a malformed answer to /api/v1/tenant_quotas")
        return rows

    def all_keys_body(self) -> bytes:
        """`/get_all_keys`: one key per line (a key holding a newline arrives split)."""
        return self._get("/get_all_keys")

    def query(self, keys: Iterable[str]) -> Iterator[tuple[str, dict]]:
        """`/batch_query_keys` for any number of keys, yielding (key, `{"ok", "error", "values":
        [replica...]}`) chunk by chunk (half a million answers held at once would cost ~1 GB).
        Grants no lease. The master splits on commas even when encoded, so keys holding a comma
        must not be passed here."""
        for body in self._bodies_ahead("/batch_query_keys?keys=" + query for query in _chunked_queries(keys)):
            yield from self._parsed_answers(body).items()

    def _bodies_ahead(self, paths: Iterator[str]) -> Iterator[bytes]:
        """The answers to `paths`, in order, each asked while the caller still uses the one before:
        the master works out the next answer while this thread parses the last (at a million keys,
        a listing waited about 4 s of its 10.5 s on the master, docs/benchmarks.md). Paths are made
        in the caller's thread; only the calls run in the other."""
        path = next(paths, None)
        following = None if path is None else next(paths, None)
        if following is None:  # one call: nothing to overlap
            if path is not None:
                yield self._get(path)
            return
        pending = self._ahead.submit(self._get, path)
        try:
            for path in itertools.chain((following,), paths):
                asked, pending = pending, self._ahead.submit(self._get, path)
                yield asked.result()
            yield pending.result()
        finally:
            pending.cancel()  # a caller that stopped early: the call not yet started is not made

    def _parsed_answers(self, body: bytes) -> dict[str, dict]:
        """A `/batch_query_keys` answer's `data`: key -> answer."""
        try:
            document = orjson.loads(body)  # a third of json's time: answers for every key, twice on peek reads
        except orjson.JSONDecodeError:  # not UTF-8 (a key's raw bytes?): decoded as the listing decodes names
            try:
                document = json.loads(body.decode("utf-8", "surrogateescape"))
            except json.JSONDecodeError:
                raise AuditError(f"admin {self.base_url} sent a non-JSON answer to batch_query_keys") from None
        if not isinstance(document, dict) or not document.get("success", False):
            raise AuditError(f"admin {self.base_url} batch_query_keys failed: {str(document)[:200]}")
        return document.get("data") or {}

    def segments(self) -> list[str]:
        body = self._get("/get_all_segments").decode(errors="replace")
        return [line.strip() for line in body.splitlines() if line.strip()]


def local_address_towards(master: str) -> str:
    """The local IP the OS would use to reach the master: the auditor's transfer endpoint."""
    host, _, port = master.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port or 1)))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


def _reachable(master: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on a wrong --master: the client's own setup retries for about 90 s."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except ValueError:
        raise AuditError(f"--master must be HOST:PORT, not {master!r}") from None
    except OSError as error:
        raise AuditError(f"master {master} unreachable: {error.strerror or error}") from None


def open_store(settings: Settings, local_buffer_mb: int = 16, tenant: str | None = None):
    """A `MooncakeDistributedStore` client that mounts no segment (global_segment_size=0); with
    `tenant`, one that joins that tenant (setup's 11th argument), whose keys only it can see."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        raise AuditError(f"the Mooncake client is not importable ({error}); see docs/quickstart.md") from None
    _reachable(settings.master)
    store = MooncakeDistributedStore()
    hostname = settings.local_hostname or local_address_towards(settings.master)
    arguments = [hostname, settings.metadata, 0, local_buffer_mb << 20, settings.protocol, settings.device_name,
                 settings.master]
    if tenant is not None:
        arguments += [None, False, "", tenant]  # engine, enable_ssd_offload, ssd_offload_path, tenant_id
    with native_stderr_captured() as captured, accept_shortened():  # close() then takes milliseconds, not 0-1 s
        rc = store.setup(*arguments)
    if rc != 0:
        last = captured.last_line()
        raise AuditError(f"cannot set up the Mooncake client (master {settings.master}, metadata "
                         f"{settings.metadata}{f', tenant {tenant}' if tenant else ''}, setup returned {rc})"
                         + (f": {last}" if last else ""))
    return store


class native_stderr_captured:
    """Holds what the C++ client writes to fd 2 during setup (its normal handshake logs an
    ERROR line for every new client); the last line explains a failed setup."""

    def __enter__(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc_info):
        os.dup2(self._saved, 2)
        os.close(self._saved)

    def last_line(self) -> str:
        self._file.seek(0)
        lines = [line for line in self._file.read().decode(errors="replace").splitlines()
                 if line.strip() and "Logging before InitGoogleLogging" not in line]
        self._file.close()
        return lines[-1].split("] ", 1)[-1][:200] if lines else ""
