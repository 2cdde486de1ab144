"""PREFIX_MISMATCH in a real scan (issue #40 §3): a state of these weights whose layer-0 rows decode
to other tokens than those its producer recorded for its chunk hash is flagged; a healthy one, and
one without a record, are not; tokens whose images are shared may be any of their class."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import numpy as np

from audit.judge.plan import load_layouts
from audit.judge.prefixes import check_prefix, encoded_prefix_matches, prefix_matches
from audit.layouts.weights import token_images
from audit.prefixrecords import CONV, KV, PrefixDigest, PrefixRecords, prefix_digest, prefix_line, token_bytes
from audit.prefixtable import read_prefix_records
from audit.producers.vllm import vllm_key
from audit.recordfiles import Malformed
from audit.records import KeyRecord, Verdict
from tests.helpers import report_schema, run_cli, tiny_mamba2_checkpoint
from tests.judge.test_binding import FLAGS, MODEL, _value


def test_a_state_of_other_tokens_under_its_hash_is_prefix_mismatch(publisher, cli_args, namespace, tmp_path):
    ours = tmp_path / MODEL
    tiny_mamba2_checkpoint(ours, seed=0)
    (layout,) = load_layouts(model_configs=[ours], state_dtype="float32", ssm_dtype="float32")
    images = token_images(ours, MODEL, 1, 0)
    rng = np.random.default_rng(11)
    prefix = namespace[:-1]
    records = tmp_path / "records"
    records.mkdir()
    recorded, values = [], {}
    for i in range(6):  # healthy: each key's rows are the images of the tokens recorded for its hash
        chunk_hash, tokens = f"{i:064x}", [int(t) for t in rng.choice(32, 3, replace=False)]
        recorded.append(prefix_line(chunk_hash, 3, tokens))
        values[vllm_key(MODEL, chunk_hash, cache_prefix=prefix)] = images.images(tokens)
    swapped = vllm_key(MODEL, f"{100:064x}", cache_prefix=prefix)  # another request's state under this hash
    recorded.append(prefix_line(f"{100:064x}", 3, [4, 5, 6]))
    values[swapped] = images.images([7, 8, 9])
    earlier = vllm_key(MODEL, f"{101:064x}", cache_prefix=prefix)  # the state one token before its boundary
    recorded.append(prefix_line(f"{101:064x}", 3, [10, 11, 12]))
    values[earlier] = images.images([9, 10, 11])
    unrecorded = vllm_key(MODEL, f"{102:064x}", cache_prefix=prefix)
    values[unrecorded] = images.images([1, 2, 3])
    (records / "prefixes-host-1-0000.jsonl").write_text("\n".join(recorded) + "\n{\"hash\": 3}\n")
    for key, rows in values.items():
        publisher.put(key, _value(layout, rows, rng))

    result = run_cli("scan", *cli_args, "--prefix", prefix + "@", "--model-config", str(ours), *FLAGS,
                     "--block-tables", str(records), "--format", "json", "--no-progress")
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    flagged = {r["key"]: r for r in document["findings"]}
    assert set(flagged) == {swapped, earlier}
    for key, record in flagged.items():
        assert record["verdicts"] == ["PREFIX_MISMATCH"], record
        evidence = record["evidence"]["prefix_mismatch"]
        assert evidence["window"] == 3 and evidence["recorded_digest"] != evidence["decoded_digest"]
    assert flagged[swapped]["evidence"]["prefix_mismatch"]["decoded_digest"] == prefix_digest([7, 8, 9])
    # every key with a record compared with it (the unrecorded one is not)
    assert document["summary"]["binding"]["prefix_records"] == {"hashes": 8, "conflicting": 0, "skipped_lines": 1,
                                                                "keys_checked": 8}


def test_shared_images_may_be_any_token_of_their_class():
    """Tokens 3 and 5 have one image (tied embeddings): rows decoded as 3 match a record of 5."""
    images = SimpleNamespace(twins={3: np.array([3, 5]), 5: np.array([3, 5])}, region="conv")
    records = PrefixRecords()
    records.add("ab", PrefixDigest(3, prefix_digest([1, 5, 2])))
    records.add("cd", PrefixDigest(3, prefix_digest([1, 6, 2])))
    kept = KeyRecord(key=vllm_key(MODEL, "ab"), size=0, fields=None)
    assert check_prefix(kept, np.array([1, 3, 2]), images, records) is False and kept.verdicts == []
    wrong = KeyRecord(key=vllm_key(MODEL, "cd"), size=0, fields=None)
    assert check_prefix(wrong, np.array([1, 3, 2]), images, records) is True
    assert wrong.verdicts == [Verdict.PREFIX_MISMATCH]
    assert wrong.evidence["prefix_mismatch"]["shared_images"] == 1
    assert check_prefix(KeyRecord(key=vllm_key(MODEL, "ef"), size=0, fields=None), np.array([1, 3, 2]), images, records) is None


def test_a_guards_packed_records_are_compared_as_the_records_themselves_are():
    """The guards compare a load's tokens with the records as kept (packed integers) and their
    encoded bytes: every answer is `prefix_matches`' on the record itself, for both regions, right and
    wrong tokens, windows longer than the rows and a record whose digest is not packed."""
    records = PrefixRecords()
    decoded = np.array([7, 1, 5, 2, 9, 4])
    for chunk_hash, region, window, tokens in [("aa", CONV, 3, [2, 9, 4]), ("bb", CONV, 3, [2, 9, 3]),
                                               ("cc", KV, 4, [7, 1, 5, 2]), ("dd", KV, 4, [7, 1, 5, 3]),
                                               ("ee", CONV, 8, [1] * 8), ("ff", KV, 6, [7, 1, 5, 2, 9, 4])]:
        digest = PrefixDigest(window, prefix_digest(tokens))
        records.add(chunk_hash, *((digest, None) if region == CONV else (None, digest)))
        packed = records.packed(chunk_hash, region)
        assert isinstance(packed, int)
        whole = prefix_matches(decoded, records.get(chunk_hash, region), {}, region)
        assert prefix_matches(decoded, packed, {}, region) == whole
        assert encoded_prefix_matches(token_bytes(decoded), packed, region) == (whole is True)
    assert [encoded_prefix_matches(token_bytes(decoded), records.packed(h, r), r) for h, r in
            [("aa", CONV), ("bb", CONV), ("cc", KV), ("dd", KV), ("ee", CONV), ("ff", KV)]] == \
        [True, False, True, False, False, True]
    text = PrefixDigest(3, "not-a-hex-digest")  # kept as the record wrote it: left to prefix_matches
    assert encoded_prefix_matches(token_bytes(decoded), text, CONV) is False
    assert prefix_matches(decoded, text, {}, CONV) is False


def test_a_hash_recorded_with_two_digests_claims_nothing(tmp_path):
    (tmp_path / "prefixes-a-1-0000.jsonl").write_text(prefix_line("AB", 3, [1, 2, 3]) + "\n")
    (tmp_path / "prefixes-b-2-0000.jsonl").write_text(prefix_line("ab", 3, [1, 2, 4]) + "\n"
                                                      + prefix_line("cd", 3, [1, 2, 3]) + "\n")
    (tmp_path / "blocks-a-1-0000.jsonl").write_text('{"key": "x", "block_ids": [1]}\n')
    records = read_prefix_records([tmp_path])
    assert records.records == 3 and records.conflicts == {"ab"} and records.get("AB") is None
    assert records.get("cd") == PrefixDigest(3, prefix_digest([1, 2, 3])) and len(records) == 1


def test_the_recorders_lines_read_without_json_read_as_json_reads_them(tmp_path):
    """`read_prefix_records` reads the recorder's own lines by a pattern: every line, odd or not, ends
    in the same records as the JSON path's (`parse_prefix_record` of `json.loads`), skips included."""
    from audit.prefixrecords import parse_prefix_record
    from audit.recordfiles import Malformed

    h, d = "ab" * 32, "0123456789abcdef"
    lines = [prefix_line(h, 3, [1, 2, 3]), prefix_line("cd" * 32, None, None, [4, 5]),
             prefix_line("ef" * 32, 2, [6, 7], [8, 9, 10]), prefix_line("AB" * 32, 3, [1, 2, 4]),  # a conflict, in capitals
             f'{{"hash":"{"12" * 32}","window":3,"digest":"{d}","kv_window":2,"kv_digest":"{d}"}}',  # KV in version 1
             f'{{"hash":"{"34" * 32}","window":0,"digest":"{d}"}}', f'{{"hash":"abc","window":3,"digest":"{d}"}}',
             f'{{"v":2,"hash":"{"56" * 32}"}}', f'{{"v":3,"hash":"{"78" * 32}","window":3,"digest":"{d}"}}',
             f'{{"hash":"{"9a" * 32}","window":3,"digest":"{d[:8]}"}}', "not json", "",
             prefix_line("bc" * 32, None, None, [4, 5], 0), prefix_line("de" * 32, 2, [6, 7], [8, 9, 10], 4096),
             f'{{"v":2,"hash":"{"f0" * 32}","kv_window":2,"kv_digest":"{d}","kv_start":-1}}']  # a start below 0
    (tmp_path / "prefixes-host-1-0000.jsonl").write_text("\n".join(lines) + "\n")
    read = read_prefix_records([tmp_path])
    reference = PrefixRecords()
    for line in filter(None, lines):
        try:
            reference.add(*parse_prefix_record(json.loads(line)))
        except (ValueError, Malformed):
            reference.skipped += 1
    every = {h.lower() for line in lines if line.startswith("{") for h in [json.loads(line)["hash"]]}
    assert {(h, region): read.get(h, region) for h in every for region in ("conv", "v")} == \
        {(h, region): reference.get(h, region) for h in every for region in ("conv", "v")}
    assert (read.conflicts, read.records, read.skipped, len(read)) == \
        (reference.conflicts, reference.records, reference.skipped, len(reference))
    assert read.conflicts == {h} and read.skipped == 5 and read.records == 9
    assert read.get("EF" * 32, "v") == PrefixDigest(3, prefix_digest([8, 9, 10]))
    assert read.get("BC" * 32, "v") == PrefixDigest(2, prefix_digest([4, 5]), 0)
    assert read.get("de" * 32, "v").start == 4096 and read.get("de" * 32).start is None
    assert read.get("abc") == PrefixDigest(3, d) and read.get("9A" * 32) == PrefixDigest(3, d[:8])


def test_the_batch_check_decides_every_key_as_the_key_by_key_check_does():
    """`check_prefixes` (a packed record's digest compared at once; a batch of hex hashes of one
    length looked up in the sorted tables and digested as one array) flags, passes and counts
    exactly the keys `check_prefix` does: healthy, swapped, no record, a hash in capitals, an odd or
    non-hex hash recorded as text, a window longer than the rows, shared images, a digest not of 16
    digits, for a conv window and an attention block's first tokens; the records in a dict or in
    tables, the tokens in arrays or in one array, the batch mixed or only 64-digit hashes."""
    from audit.judge.prefixes import check_prefixes
    from audit.prefixtable import PrefixTable

    def recorded() -> PrefixRecords:
        records = PrefixRecords()
        records.add("ab" * 32, PrefixDigest(3, prefix_digest([1, 2, 3])), PrefixDigest(2, prefix_digest([1, 2])))
        records.add("cd" * 32, PrefixDigest(3, prefix_digest([7, 8, 9])), PrefixDigest(2, prefix_digest([7, 8])))
        records.add("abc", PrefixDigest(3, prefix_digest([1, 2, 3])))
        records.add("ef" * 32, PrefixDigest(4, prefix_digest([0, 1, 2, 3])))
        records.add("12" * 32, PrefixDigest(3, prefix_digest([1, 5, 3])))
        records.add("34" * 32, PrefixDigest(3, "0123"))
        return records

    cases = [("ab" * 32, [1, 2, 3]), ("cd" * 32, [1, 2, 3]), ("56" * 32, [1, 2, 3]), ("AB" * 32, [1, 2, 3]),
             ("CD" * 32, [7, 8, 9]), ("abc", [1, 2, 3]), ("abc", [1, 2, 4]), ("ef" * 32, [1, 2, 3]),
             ("12" * 32, [1, 3, 3]), ("12" * 32, [1, 4, 3]), ("34" * 32, [1, 2, 3]), ("zz", [1, 2, 3])]
    flagged_of = {"conv": [1, 6, 9, 10], "v": [1]}  # cases' indices; "ef" (4 tokens > 3 rows): not compared
    tables = PrefixTable({}, recorded())
    assert len(tables.tables) == 2 and tables.rest.digests  # (hex hashes in tables; "abc" and "34..." not)
    hexed = [i for i, (h, _) in enumerate(cases) if len(h) == 64]
    for region in ("conv", "v"):
        images = SimpleNamespace(twins={3: np.array([3, 5]), 5: np.array([3, 5])}, region=region)
        one_by_one = [KeyRecord(key=vllm_key(MODEL, h), size=0, fields=None) for h, _ in cases]
        expected = [check_prefix(r, np.array(t), images, recorded()) is not None for r, (_, t) in zip(one_by_one, cases)]
        assert [i for i, r in enumerate(one_by_one) if r.verdicts] == flagged_of[region]
        assert sum(expected) == {"conv": 9, "v": 4}[region]
        for prefixes in (recorded(), tables):
            for chosen in (range(len(cases)), hexed):
                for as_array in (False, True):
                    batched = [KeyRecord(key=vllm_key(MODEL, cases[i][0]), size=0, fields=None) for i in chosen]
                    rows = np.array([cases[i][1] for i in chosen])
                    checked = check_prefixes(batched, rows if as_array else list(rows), images, prefixes)
                    assert checked == sum(expected[i] for i in chosen)
                    assert [(r.verdicts, r.evidence) for r in batched] == \
                        [(one_by_one[i].verdicts, one_by_one[i].evidence) for i in chosen]


def test_the_sorted_tables_answer_as_a_dict_of_the_same_lines_does(tmp_path, monkeypatch):
    """`read_prefix_records` (whole pieces of a file decoded a shape of line at a time into sorted
    tables, looked up a batch at a time) against a `PrefixRecords` fed the same lines through the
    JSON parser, on 3,000 lines over four files read 4 KiB at a time: hashes of two lengths, in
    capitals, repeated, recorded again with another digest (in either region), KV blocks with and
    without their start (a start with a leading zero: not JSON), text, odd and
    non-ASCII hashes, digests not of 16 digits, JSON spellings the recorder does not write, broken
    lines, blank lines, a file in CRLF, a last line without its newline; every hash asked for, one
    at a time and as a batch."""
    import audit.prefixtable
    from audit.prefixrecords import hash_key, parse_prefix_record

    monkeypatch.setattr(audit.prefixtable, "PIECE_BYTES", 4096)

    rng = np.random.default_rng(53)
    pool = [f"{rng.integers(1 << 62):016x}" * k for k in (4, 2) for _ in range(300)]  # 32- and 16-byte hashes
    pool += [f"{i:064x}" for i in range(1, 41)] + ["abc", "text-hash", "00" * 32, "caf\u00e9"]  # (40 share a first 8 bytes)

    def digest() -> str:
        return str(rng.choice([prefix_digest(rng.integers(0, 9, 3).tolist()), prefix_digest([1]), "ABCDEF0123456789",
                               "12ab"], p=[0.85, 0.05, 0.05, 0.05]))

    def start() -> str:  # a KV block's start: most recorded (0 among them), some not
        return str(rng.choice(["", ',"kv_start":0', f',"kv_start":{16 * rng.integers(1, 5000)}', ',"kv_start":07'],
                              p=[0.3, 0.1, 0.55, 0.05]))

    recorded = {h: (f',"window":{rng.integers(1, 4)},"digest":"{digest()}"',
                    f',"kv_window":{rng.integers(1, 17)},"kv_digest":"{digest()}"{start()}') for h in pool}
    lines = []
    for _ in range(3000):
        h = str(rng.choice(pool))
        conv, kv = recorded[h] if rng.random() < 0.98 else (f',"window":3,"digest":"{digest()}"',
                                                             f',"kv_window":16,"kv_digest":"{digest()}"')
        h = h.upper() if rng.random() < 0.1 else h
        conv = conv if rng.random() < 0.8 else ""
        kv = kv if not conv or rng.random() < 0.3 else ""
        line = f'{{"v":2,"hash":"{h}"{conv}{kv}}}' if kv or rng.random() < 0.5 else f'{{"hash":"{h}"{conv}}}'
        line = line.replace(",", ", ") if rng.random() < 0.05 else line
        lines.append(line if rng.random() > 0.02 else str(rng.choice(['{"hash": 3}', line[:-1], line.replace(":1,", ":0,")])))
    parts = np.array_split(np.array(lines, dtype=object), 4)
    for n, (part, (newline, last)) in enumerate(zip(parts, [("\n", "\n"), ("\r\n", "\r\n"), ("\n\n", ""), ("\n", "")])):
        (tmp_path / f"prefixes-h-{n}-0000.jsonl").write_bytes((newline.join(part) + last).encode())
    read = read_prefix_records([tmp_path])
    reference = PrefixRecords()
    for line in lines:
        try:
            reference.add(*parse_prefix_record(json.loads(line)))
        except (ValueError, Malformed):
            reference.skipped += 1
    assert 10 < len(read.conflicts) < 100 and len(read) > 500 and read.skipped > 10  # (what the lines were made to hold)
    assert (read.conflicts, read.records, read.skipped, len(read)) == \
        (reference.conflicts, reference.records, reference.skipped, len(reference))
    asked = [h for h in pool] + [h.upper() for h in pool] + ["ff" * 32, "notthere"]
    for region in ("conv", "v"):
        assert [read.get(h, region) for h in asked] == [reference.get(h, region) for h in asked]
        keys = [hash_key(h) if isinstance(hash_key(h), bytes) else None for h in asked]
        assert read.packed_many(keys, region) == reference.packed_many(keys, region)
