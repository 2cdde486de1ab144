"""audit.recordfiles: record files read whole, and the whole lines appended since the last read."""

from __future__ import annotations

import os

import pytest

from audit.errors import AuditError
from audit.recordfiles import AppendedLines, Malformed, numbered_lines, parsed_lines


def _lines(appended) -> list[tuple[str, int, list[str]]]:
    return [(new.path.name, new.lines_before, new.data.decode().splitlines()) for new in appended]


def test_a_line_still_being_written_waits_for_its_newline(tmp_path):
    path = tmp_path / "blocks-a.jsonl"
    path.write_bytes(b"one\ntw")
    cursors = AppendedLines()
    assert _lines(cursors.read([path])) == [("blocks-a.jsonl", 0, ["one"])]
    assert cursors.read([path]) == []
    with open(path, "ab") as handle:
        handle.write(b"o\nthree\n")
    assert _lines(cursors.read([path])) == [("blocks-a.jsonl", 1, ["two", "three"])]
    assert cursors.bytes_read == len(b"one\ntwo\nthree\n")


def test_a_truncated_or_replaced_file_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "blocks-a.jsonl"
    path.write_bytes(b"one\ntwo\n")
    cursors = AppendedLines()
    cursors.read([path])
    path.write_bytes(b"x\n")  # truncated: shorter than the offset read to
    assert _lines(cursors.read([path])) == [("blocks-a.jsonl", 0, ["x"])]
    rotated = tmp_path / "blocks-b.jsonl"
    rotated.write_bytes(b"new one\nnew two\nnew three\n")
    os.replace(rotated, path)  # another inode under the same name, longer than before
    assert _lines(cursors.read([path])) == [("blocks-a.jsonl", 0, ["new one", "new two", "new three"])]


def test_files_are_read_each_from_its_own_cursor_and_forgotten_when_gone(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_bytes(b"a1\n")
    second.write_bytes(b"b1\nb2\n")
    cursors = AppendedLines()
    assert _lines(cursors.read([first, second])) == [("a.jsonl", 0, ["a1"]), ("b.jsonl", 0, ["b1", "b2"])]
    first.unlink()
    with open(second, "ab") as handle:
        handle.write(b"b3\n")
    assert _lines(cursors.read([first, second])) == [("b.jsonl", 2, ["b3"])]
    first.write_bytes(b"again\n")  # a new file under a name seen before: from its start
    assert _lines(cursors.read([first, second])) == [("a.jsonl", 0, ["again"])]


def test_an_unreadable_file_raises_unless_skipped(tmp_path):
    unreadable = tmp_path / "c.jsonl"
    unreadable.mkdir()  # stat answers (a size), open fails: as a file that cannot be opened
    (unreadable / "inside").write_bytes(b"x" * 10)
    readable = tmp_path / "d.jsonl"
    readable.write_bytes(b"d\n")
    with pytest.raises(IsADirectoryError):
        AppendedLines().read([unreadable, readable])
    assert _lines(AppendedLines().read([unreadable, readable], skip_unreadable=True)) == [("d.jsonl", 0, ["d"])]


def test_whole_files_name_file_and_line_of_a_malformed_record_or_skip_it(tmp_path):
    path = tmp_path / "loads-a.jsonl"
    path.write_text('{"n": 1}\n\n[2]\n{"n": -1}\nnot json\n{"n": 3}\n')

    def parse(record: dict) -> int:
        if record["n"] < 0:
            raise Malformed("'n' must be >= 0")
        return record["n"]

    with pytest.raises(AuditError, match=r"load records .*loads-a.jsonl:3: a line must hold a JSON object"):
        list(parsed_lines(numbered_lines(path, "load records"), path, "load records", parse, lenient=False,
                          skipped=lambda: None))
    skips = []
    parsed = list(parsed_lines(numbered_lines(path, "load records"), path, "load records", parse, lenient=True,
                               skipped=lambda: skips.append(1)))
    assert parsed == [(1, 1), (6, 3)] and len(skips) == 3


def test_a_file_that_is_not_utf8_or_cannot_be_opened_is_one_error(tmp_path):
    path = tmp_path / "blocks-a.jsonl"
    path.write_bytes(b'{"n": 1}\n\xff\xfe\n')
    with pytest.raises(AuditError, match=r"block table .*blocks-a.jsonl: not UTF-8 text"):
        list(numbered_lines(path, "block table"))
    with pytest.raises(AuditError, match=r"cannot read block table .*missing.jsonl"):
        list(numbered_lines(tmp_path / "missing.jsonl", "block table"))
