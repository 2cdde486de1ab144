"""`--evidence DIR`: flagged keys' bytes and sidecars, saved from the read buffer."""

from __future__ import annotations

import gzip
import json
import stat

import numpy as np
import xxhash

from audit.forensics.evidence import key_file_name
from tests.helpers import run_cli


def test_evidence_holds_the_bytes_and_final_verdicts_of_every_flagged_key(publisher, cli_args, namespace, tmp_path):
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 30_000, dtype=np.uint8).tobytes()
    values = {"zero\nkey": bytes(5000), "dup-a": shared, "dup-b": shared, "fine": rng.bytes(7000)}
    for name, value in values.items():
        publisher.put(namespace + name, value)
    evidence = tmp_path / "evidence"
    result = run_cli("scan", *cli_args, "--prefix", namespace, "--evidence", str(evidence), "--format", "json",
                     "--no-progress")
    assert result.exit_code == 1
    assert stat.S_IMODE(evidence.stat().st_mode) == 0o700
    index = [json.loads(line) for line in (evidence / "index.jsonl").read_text().splitlines()]
    assert sorted(entry["key"] for entry in index) == sorted(namespace + n for n in ("zero\nkey", "dup-a", "dup-b"))
    for name in ("zero\nkey", "dup-a", "dup-b"):
        sidecar = json.loads((evidence / "keys" / key_file_name(namespace + name)).read_text())
        assert sidecar["key"] == namespace + name
        raw = gzip.decompress((evidence / sidecar["blob"]).read_bytes())
        assert raw == values[name] and sidecar["xxh3"] == f"{xxhash.xxh3_64_intdigest(raw):016x}"
        assert sidecar["replicas"] and sidecar["replicas"][0]["endpoint"]
    dup = json.loads((evidence / "keys" / key_file_name(namespace + "dup-a")).read_text())
    assert dup["verdicts"] == ["SHARED_CONTENT"] and dup["reason"] == "shared_content"
    assert len(list((evidence / "blobs").iterdir())) == 2  # identical values are stored once
    assert not (evidence / "keys" / key_file_name(namespace + "fine")).exists()
