"""The data every stage passes on: what a key is, what was found in it, and the report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from audit.keys import parse_key, split_stem


class Verdict(StrEnum):
    # Findings: each has a severity (SEVERITY); errors exit 1, warnings only with --fail-on warning.
    ZERO_VALUE = "ZERO_VALUE"              # every byte of the value is zero
    SHARED_CONTENT = "SHARED_CONTENT"      # identical non-zero bytes under two or more distinct keys
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"  # Mooncake's CRC check failed on read (-801)
    # Findings that need the value's layout or the producer's block tables (vLLM #53084).
    NULL_BACKED = "NULL_BACKED"            # a block table maps the key to NULL_BLOCK_ID (0)
    ZERO_STATE = "ZERO_STATE"              # every conv and ssm region all zero
    PARTIAL_ZERO = "PARTIAL_ZERO"          # some layers' state regions all zero, not all
    NONFINITE = "NONFINITE"                # NaN or Inf in a state or KV region
    SIZE_MISMATCH = "SIZE_MISMATCH"        # the value's size is not its layout's
    REPLICA_DIVERGENT = "REPLICA_DIVERGENT"  # two replicas of the key hold different bytes
    # Cross-key findings from key names, sizes and digests (docs/verdicts.md).
    INCOMPLETE_CHUNK = "INCOMPLETE_CHUNK"  # a member its producer publishes with this key is missing
    IDENTITY_SUSPECT = "IDENTITY_SUSPECT"  # size or bytes unlike the producer the name claims
    # From `verify`: the value differs from a reference producer's recomputation of the same key.
    DIVERGENT_STATE = "DIVERGENT_STATE"    # a state/KV region beyond tolerance of its reference twin
    # Needs the producer's weights (--model-config DIR with the checkpoint): layer-0 binding.
    WEIGHTS_MISMATCH = "WEIGHTS_MISMATCH"  # layer 0's conv rows are not images of any token under them
    # ... and the producer's prefix records (--block-tables DIR): the tokens its chunk hash names.
    PREFIX_MISMATCH = "PREFIX_MISMATCH"    # layer 0's conv rows are images of other tokens than those
    # Needs a purge's log (--purged LOG): a key `purge --yes` removed is listed again with the same bytes.
    PURGED_RETURNED = "PURGED_RETURNED"    # e.g. its disk copy, registered again by a restarted holder
    # Recorded, not a finding: the key went away or changed between listing and reading.
    VANISHED = "VANISHED"                  # -704
    MOVED = "MOVED"                        # a lease-free read raced a change: the descriptor moved
    # Recorded, not a finding: what a producer writes by design (docs/producers.md).
    EXPECTED_DUPLICATE = "EXPECTED_DUPLICATE"  # identical bytes its producer puts under several keys
    WARMUP_KEY = "WARMUP_KEY"              # a probe the producer writes at start-up, not cache
    # Incomplete: the key could not be read; exit 3 when there is no finding.
    UNREACHABLE = "UNREACHABLE"            # -800: the holder of the bytes is gone
    READ_ERROR = "READ_ERROR"              # any other failure
    # Not judged fully: the value's size fits several layouts (dtypes, boundaries), the bytes could
    # not choose, and the readings disagree on a verdict (withheld; docs/vllm.md). Exit 3 alone.
    AMBIGUOUS_LAYOUT = "AMBIGUOUS_LAYOUT"


FINDINGS = frozenset({Verdict.ZERO_VALUE, Verdict.SHARED_CONTENT, Verdict.CHECKSUM_MISMATCH,
                      Verdict.NULL_BACKED, Verdict.ZERO_STATE, Verdict.PARTIAL_ZERO, Verdict.NONFINITE,
                      Verdict.SIZE_MISMATCH, Verdict.REPLICA_DIVERGENT, Verdict.INCOMPLETE_CHUNK,
                      Verdict.IDENTITY_SUSPECT, Verdict.DIVERGENT_STATE, Verdict.WEIGHTS_MISMATCH,
                      Verdict.PREFIX_MISMATCH, Verdict.PURGED_RETURNED})
INCOMPLETE = frozenset({Verdict.UNREACHABLE, Verdict.READ_ERROR})


class Severity(StrEnum):
    """How bad a finding is (docs/verdicts.md#severity): an error is bytes a consumer would use
    wrongly; a warning is waste or doubt."""

    ERROR = "error"
    WARNING = "warning"


SEVERITY = {Verdict.ZERO_VALUE: Severity.ERROR, Verdict.ZERO_STATE: Severity.ERROR, Verdict.NULL_BACKED: Severity.ERROR,
            Verdict.PARTIAL_ZERO: Severity.ERROR, Verdict.NONFINITE: Severity.ERROR,
            Verdict.SIZE_MISMATCH: Severity.ERROR, Verdict.CHECKSUM_MISMATCH: Severity.ERROR,
            Verdict.REPLICA_DIVERGENT: Severity.ERROR, Verdict.DIVERGENT_STATE: Severity.ERROR,
            Verdict.WEIGHTS_MISMATCH: Severity.ERROR, Verdict.PREFIX_MISMATCH: Severity.ERROR,
            Verdict.PURGED_RETURNED: Severity.ERROR,
            Verdict.IDENTITY_SUSPECT: Severity.ERROR,  # a size outlier alone: a warning (verdict_severity)
            Verdict.SHARED_CONTENT: Severity.WARNING, Verdict.INCOMPLETE_CHUNK: Severity.WARNING}


def verdict_severity(verdict: str, evidence: dict) -> Severity | None:
    """A verdict's severity on one key; None for what is not a finding. IDENTITY_SUSPECT is an error
    when bytes show the mixup (a rank's copy, a header naming another chunk), a warning when only
    the size stands out."""
    if verdict == Verdict.IDENTITY_SUSPECT and "value_identity" not in evidence \
            and "rank_mixup" not in (evidence.get("identity") or {}):
        return Severity.WARNING
    return SEVERITY.get(verdict)
UNJUDGED = frozenset({Verdict.AMBIGUOUS_LAYOUT})


@dataclass(slots=True)
class KeyInfo:
    """A listed key: its exact name, its size from the lease-free query, its replicas.

    Parsed fields are not kept for every listed key (a million dicts would dominate the
    auditor's memory): `parsed_fields()` derives them when needed.
    """

    name: str
    size: int | None = None
    fields: dict | None = None
    replicas: list[dict] = field(default_factory=list)
    tenant: str | None = None  # the Mooncake tenant holding it; None: the default tenant (the listing's)
    ordinal: int | None = None  # its row in the listing's KeyTable, where it came from one

    def parsed_fields(self) -> dict:
        return self.fields if self.fields is not None else parse_key(self.name)

    def stem(self) -> str:
        """Its name without a trailing `@{hex}` chunk hash: keys of one stem differ only in their
        chunk hash, so what their fields say of model, group and ranks is parsed once a stem."""
        split = split_stem(self.name)
        return self.name if split is None else split[0]


@dataclass(slots=True)
class KeyRecord:
    """What the audit learned about one key; `verdicts` empty means OK."""

    key: str
    size: int | None
    fields: dict | None  # None: derived from the key when needed (records of clean keys stay small)
    xxh3: int | None = None
    zero: bool | None = None
    verdicts: list[str] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
    error: dict | None = None
    layout: str | None = None           # which layout described the value, if any
    regions: list[dict] | None = None   # per-region results (findings, or every key with --all)
    tenant: str | None = None           # the Mooncake tenant it was read in; None: the default tenant
    ordinal: int | None = None          # its key's row in the listing's KeyTable (not in the report)

    def parsed_fields(self) -> dict:
        return self.fields if self.fields is not None else parse_key(self.key)

    @property
    def is_finding(self) -> bool:
        return any(v in FINDINGS for v in self.verdicts)

    @property
    def severity(self) -> Severity | None:
        """The worst severity among its verdicts; None when it has no finding."""
        found = {verdict_severity(v, self.evidence) for v in self.verdicts} - {None}
        return Severity.ERROR if Severity.ERROR in found else (Severity.WARNING if found else None)

    @property
    def is_incomplete(self) -> bool:
        return any(v in INCOMPLETE for v in self.verdicts)

    @property
    def is_unjudged(self) -> bool:
        """Read, but some verdict withheld: the bytes fit readings that disagree."""
        return any(v in UNJUDGED for v in self.verdicts)

    def to_json(self) -> dict:
        document = {
            "key": self.key,
            "verdicts": list(self.verdicts),
            "size": self.size,
            "xxh3": None if self.xxh3 is None else f"{self.xxh3:016x}",
            "zero": self.zero,
            "fields": self.parsed_fields(),
            "evidence": self.evidence,
        }
        if (severity := self.severity) is not None:
            document["severity"] = str(severity)
        if self.error is not None:
            document["error"] = self.error
        if self.layout is not None:
            document["layout"] = self.layout
        if self.regions is not None:
            document["regions"] = self.regions
        if self.tenant is not None:
            document["tenant"] = self.tenant
        return document

    @classmethod
    def from_json(cls, document: dict) -> KeyRecord:
        """A record read back from a report (for `crossref`, `diff`, merging shards)."""
        digest = document.get("xxh3")
        return cls(key=document["key"], size=document.get("size"), fields=document.get("fields") or {},
                   xxh3=None if digest is None else int(digest, 16), zero=document.get("zero"),
                   verdicts=list(document.get("verdicts") or []), evidence=dict(document.get("evidence") or {}),
                   error=document.get("error"), layout=document.get("layout"), regions=document.get("regions"),
                   tenant=document.get("tenant"))


@dataclass(slots=True)
class Report:
    """The merged outcome of a scan: a summary plus every key's record."""

    summary: dict
    records: Sequence[KeyRecord]  # every record; a RecordLedger holds the plain ones compactly
    shared_groups: list[dict]
    expected_duplicates: list[dict] = field(default_factory=list)  # groups of EXPECTED_DUPLICATE keys

    @property
    def findings(self) -> list[KeyRecord]:
        findings = getattr(self.records, "findings", None)  # a ledger knows them without a walk
        return findings() if findings is not None else [record for record in self.records if record.is_finding]

    @property
    def exit_code(self) -> int:
        return self.summary["exit_code"]
