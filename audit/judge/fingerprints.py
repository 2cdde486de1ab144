"""WEIGHTS_MISMATCH from the producer's own account: its manifest's checkpoint fingerprint is not
the fingerprint of the weights the operator gave (``--model-config DIR``).

Layer-0 binding sees other weights only where layer 0 changed; a fine-tune that kept the embeddings
and layer 0 publishes states that bind. The recorder fingerprints every byte of the checkpoint vLLM
loaded (`audit.layouts.fingerprint`), so a producer that served other weights is known by its
manifest, and every key it put is flagged. Which producer put a key: the recorder's put record the
key's bytes come from (`BlockTableEntry.origin`, in ``blocks-{host}-{pid}-{n}.jsonl``), the manifest
of that host and pid, and a put no earlier than the manifest (a later process that reused the pid
rewrote the manifest; the keys of the earlier one are not claimed). Fingerprints are compared once
per manifest when the plan is made; a key costs a dictionary lookup."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from audit.blocktables import BlockTables
from audit.errors import AuditError
from audit.layouts import LayoutError
from audit.layouts.fingerprint import FINGERPRINT_ENV, fingerprint, fingerprint_enabled
from audit.layouts.manifest import ProducerManifests
from audit.records import KeyRecord, Verdict

_PUT_RECORDS = re.compile(r"blocks-(?P<producer>.+-\d+)-\d+\.jsonl")

SAME, OTHER = "same weights", "other weights"
NO_FINGERPRINT = "no fingerprint in the manifest: nothing claimed"


@dataclass
class ProducerWeights:
    """Per manifest of a model given with its checkpoint: whether its producer loaded these weights."""

    rows: list[dict] = field(default_factory=list)       # per manifest, for the report's binding summary
    other: dict[str, dict] = field(default_factory=dict)  # producer ("host-pid") -> evidence
    since: dict[str, float] = field(default_factory=dict)  # producer -> its manifest's written_at
    off: bool = False
    _producers: dict[str, str | None] = field(default_factory=dict, repr=False)  # record file -> producer

    @classmethod
    def compare(cls, manifests: ProducerManifests | None, directories: dict[str, Path]) -> ProducerWeights:
        """Each manifest's fingerprint against its model's directory's (computed once per directory,
        and only for a manifest that carries one)."""
        try:
            enabled = fingerprint_enabled()
        except ValueError as error:
            raise AuditError(str(error)) from None
        weights = cls(off=not enabled)
        checkpoints: dict[str, dict] = {}
        for manifest in manifests.manifests if manifests is not None else ():
            document = manifest.document
            model = document.get("model")
            if model not in directories:
                continue
            producer = f"{document.get('host')}-{document.get('pid')}"
            row = {"manifest": str(manifest.path), "model": model, "producer": producer}
            weights.rows.append(row)
            carried = document.get("fingerprint") or {}
            if not carried.get("complete") or not carried.get("digest"):
                row["status"] = NO_FINGERPRINT if not carried else (
                    f"fingerprint not complete ({carried.get('note')}): nothing claimed")
                continue
            if weights.off:
                row["status"] = f"{FINGERPRINT_ENV}=off: not compared"
                continue
            if model not in checkpoints:
                checkpoints[model] = _checkpoint(directories[model])
            mine = checkpoints[model]
            if "error" in mine:
                row["status"] = f"cannot fingerprint {directories[model]}: {mine['error']}"
                continue
            row.update(producer_fingerprint=carried["digest"], checkpoint_fingerprint=mine["digest"],
                       algorithm=carried.get("algorithm"))
            if carried.get("algorithm") != mine["algorithm"]:
                row["status"] = f"fingerprint by {carried.get('algorithm')!r}, not {mine['algorithm']!r}: not compared"
            elif carried["digest"] == mine["digest"]:
                row["status"] = SAME
            else:
                row["status"] = OTHER
                row["same_architecture"] = carried.get("header") is not None and carried.get("header") == mine["header"]
                weights.other[producer] = {"producer_fingerprint": carried["digest"],
                                           "checkpoint_fingerprint": mine["digest"], "manifest": str(manifest.path),
                                           "producer": producer, "same_architecture": row["same_architecture"]}
                weights.since[producer] = float(document.get("written_at") or 0.0)
        return weights

    def flag(self, records: list[KeyRecord], tables: BlockTables | None) -> None:
        """WEIGHTS_MISMATCH on every record whose key a producer with other weights put."""
        if not self.other or tables is None:
            return
        for record in records:
            entry = tables.get(record.key)
            if entry is None or entry.origin is None or entry.stored_at is None:
                continue
            producer = self._producer(entry.origin)
            if producer in self.other and entry.stored_at >= self.since[producer]:
                if Verdict.WEIGHTS_MISMATCH not in record.verdicts:
                    record.verdicts.append(Verdict.WEIGHTS_MISMATCH)
                record.evidence["weights_fingerprint"] = self.other[producer]

    def _producer(self, origin: str) -> str | None:
        """The producer of a put record's file ("file:line"), by the recorder's file name."""
        path = origin.rpartition(":")[0]
        if path not in self._producers:
            found = _PUT_RECORDS.fullmatch(Path(path).name)
            self._producers[path] = None if found is None else found["producer"]
        return self._producers[path]

    def summary(self) -> list[dict]:
        return self.rows


def _checkpoint(directory: Path) -> dict:
    try:
        return fingerprint(directory).as_dict()
    except (LayoutError, OSError, ValueError) as error:
        return {"error": str(error)}
