"""`watch`'s live metrics on `/metrics` (prometheus_client) and its liveness on `/healthz`.

Names `check` also exports keep its meaning (`mooncake_audit_findings`, `_verdict_keys`, `_keys_listed`,
`_bytes_scanned`); what only a continuous scrubber has is under `mooncake_audit_watch_`.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from audit.errors import AuditError
from audit.records import FINDINGS
from audit.report.metrics import severity_label

DETECTION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class WatchMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.keys_listed = Gauge("mooncake_audit_keys_listed", "Keys the last listing showed.", registry=registry)
        self.findings = Gauge("mooncake_audit_findings", "Keys whose last verdicts hold a finding.", registry=registry)
        self.verdict_keys = Gauge("mooncake_audit_verdict_keys", "Keys per verdict, from each key's last read.",
                                  ["verdict", "severity"], registry=registry)
        self.severity_keys = Gauge("mooncake_audit_severity_keys", "Keys whose worst finding has this severity.",
                                   ["severity"], registry=registry)
        self.bytes_scanned = Counter("mooncake_audit_bytes_scanned", "Bytes read and checked since start.",
                                     registry=registry)
        self.keys_known = Gauge("mooncake_audit_watch_keys_known", "Keys in the watcher's state.", registry=registry)
        self.keys_verified = Gauge("mooncake_audit_watch_keys_verified_within_period",
                                   "Keys read to a verdict within the last --period.", registry=registry)
        self.keys_never_verified = Gauge("mooncake_audit_watch_keys_not_yet_verified",
                                         "Keys known but not yet read to a verdict (new or unreachable).",
                                         registry=registry)
        self.oldest_age = Gauge("mooncake_audit_watch_oldest_verification_age_seconds",
                                "Age of the oldest last verification among verified keys.", registry=registry)
        self.first_seen_to_verified = Histogram(
            "mooncake_audit_watch_first_seen_to_verified_seconds",
            "Seconds from a key's first sighting to its first verdict.", buckets=DETECTION_BUCKETS, registry=registry)
        self.bytes_per_second = Gauge("mooncake_audit_watch_bytes_read_per_second",
                                      "Bytes read per second over the last round.", registry=registry)
        self.listing_seconds = Gauge("mooncake_audit_watch_listing_seconds", "Duration of the last listing.",
                                     registry=registry)
        self.listing_seconds_median = Gauge("mooncake_audit_watch_listing_seconds_median",
                                            "Median duration of the last few listings (what stretches the interval).",
                                            registry=registry)
        self.listings = Counter("mooncake_audit_watch_listings", "Listings of the store completed.", registry=registry)
        self.keys_sized = Gauge("mooncake_audit_watch_keys_sized",
                                "Keys the last listing asked the master to size (names it had not listed before; "
                                "every key in one listing of ten).", registry=registry)
        self.interval = Gauge("mooncake_audit_watch_interval_seconds",
                              "The round interval in use: --interval, stretched so the median listing stays under "
                              "its share of the time.", registry=registry)
        self.read_ahead = Gauge("mooncake_audit_watch_read_ahead_seconds",
                                "Keys are re-read once their verification is older than the period minus this.",
                                registry=registry)
        self.record_rounds = Counter("mooncake_audit_watch_record_rounds",
                                     "Rounds run between listings on the keys new block-table records name.",
                                     registry=registry)
        self.record_keys = Counter("mooncake_audit_watch_record_keys",
                                   "Keys read in record rounds (named by a new record, found in the store).",
                                   registry=registry)
        self.record_keys_pending = Gauge("mooncake_audit_watch_record_keys_pending",
                                         "Keys new records name that the store does not hold yet (retried).",
                                         registry=registry)
        self.interval_stretched = Gauge("mooncake_audit_watch_interval_stretched",
                                        "1 while the interval is stretched beyond --interval.", registry=registry)
        self.keys_unreachable = Gauge("mooncake_audit_watch_keys_unreachable",
                                      "Keys the last round could not read (retried next round).", registry=registry)
        self.master_up = Gauge("mooncake_audit_watch_master_up", "1 while the master answers.", registry=registry)
        self.disk_copies_latent = Gauge("mooncake_audit_watch_disk_copies_not_listed",
                                        "Copies in the offload directories of keys listed with no disk copy "
                                        "(a restart of the holder registers them again).", registry=registry)
        self.disk_copies_latent_unlike = Gauge("mooncake_audit_watch_disk_copies_not_listed_unlike_memory",
                                               "Of those, copies unlike the bytes in memory.", registry=registry)
        self.rounds = Counter("mooncake_audit_watch_rounds", "Rounds completed.", registry=registry)
        self.last_round = Gauge("mooncake_audit_watch_last_round_timestamp_seconds",
                                "When the last round completed.", registry=registry)
        for verdict in FINDINGS:
            self.verdict_keys.labels(verdict=str(verdict), severity=severity_label(verdict)).set(0)

    def show_state(self, counts, now: float) -> None:
        """`counts`: the state's KeyCounts (duck-typed: sinks import nothing from run control)."""
        self.keys_known.set(counts.known)
        self.keys_verified.set(counts.verified_within)
        self.keys_never_verified.set(counts.never_verified)
        self.oldest_age.set(0 if counts.oldest_verified is None else max(now - counts.oldest_verified, 0))
        self.findings.set(counts.findings)
        for verdict in FINDINGS:
            self.verdict_keys.labels(verdict=str(verdict), severity=severity_label(verdict)).set(
                counts.verdicts.get(str(verdict), 0))
        for verdict, n in counts.verdicts.items():
            self.verdict_keys.labels(verdict=verdict, severity=severity_label(verdict)).set(n)
        for severity in ("error", "warning"):
            self.severity_keys.labels(severity=severity).set(counts.severities.get(severity, 0))


class MetricsServer:
    """`/metrics` and `/healthz` on a daemon thread; healthy while rounds keep completing."""

    def __init__(self, metrics: WatchMetrics, listen: str, stale_after_s: float):
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise AuditError(f"--listen must be HOST:PORT, not {listen!r}")
        self.metrics = metrics
        self.stale_after_s = stale_after_s
        self.alive_at = time.monotonic()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] == "/metrics":
                    self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
                elif self.path.split("?")[0] == "/healthz":
                    healthy = time.monotonic() - server.alive_at < server.stale_after_s
                    self._send(200 if healthy else 503, b"ok\n" if healthy else b"stalled\n", "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                """Silent: scrapes are not worth a stderr line each."""

        try:
            self.httpd = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
        except OSError as error:
            raise AuditError(f"cannot listen on {listen}: {error.strerror}") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()

    def alive(self) -> None:
        self.alive_at = time.monotonic()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
