"""Per-key verdicts from what the read returned and what the checks found."""

from __future__ import annotations

from audit.checks.host import ValueCheck
from audit.fetch import ERROR_NAMES
from audit.records import KeyInfo, KeyRecord, Verdict

_READ_VERDICTS = {
    -704: Verdict.VANISHED,
    -800: Verdict.UNREACHABLE,
    -801: Verdict.CHECKSUM_MISMATCH,
}


def read_failure(key: KeyInfo, code: int, message: str | None = None) -> KeyRecord:
    verdict = _READ_VERDICTS.get(code, Verdict.READ_ERROR)
    error = {"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN")}
    if message:
        error["message"] = message
    return KeyRecord(key=key.name, size=key.size, fields=key.fields, verdicts=[verdict], error=error)


def judge_read(key: KeyInfo, code: int, check: ValueCheck | None) -> KeyRecord:
    if code < 0:
        return read_failure(key, code)
    if code != key.size or check is None:
        return read_failure(key, code, f"read {code} bytes, the listing said {key.size}")
    record = KeyRecord(key=key.name, size=key.size, fields=key.fields, xxh3=check.xxh3, zero=check.zero)
    if check.zero and code > 0:
        record.verdicts.append(Verdict.ZERO_VALUE)
        record.evidence["zero"] = {"digest_is_zero_digest": True, "bytes_confirmed_zero": True}
    return record
