"""`--offload-dir DIR[=ENDPOINT]` (`audit.readers.offload_index.offload_directory`): a directory with
the holder an operator names for it, which the index then holds as given, never learnt."""

from pathlib import Path

from audit.readers.offload_index import DirectoryHolder, HeldDirectory, index_directories, offload_directory


def test_a_directory_given_with_an_endpoint_names_its_holder_and_any_other_value_is_a_path(tmp_path):
    held = offload_directory(f"{tmp_path}=10.0.0.7:12345")
    assert held == HeldDirectory(tmp_path, "10.0.0.7:12345")
    assert Path(held) == tmp_path and str(held) == str(tmp_path)  # (read as its path wherever a path is wanted)
    odd = tmp_path / "a=b:1"
    odd.mkdir()
    assert offload_directory(str(odd)) == odd  # a directory as written is that directory, '=' and all
    for text in (f"{tmp_path}=host", f"{tmp_path}=:80", f"{tmp_path}=h:80/x", "=h:80"):
        assert offload_directory(text) == Path(text), text
    index = index_directories([held, odd])
    assert index.directories == [tmp_path, odd] and index.given == {tmp_path: DirectoryHolder("10.0.0.7:12345", "given")}


def test_a_copy_lies_in_the_first_directory_given_that_holds_it(tmp_path):
    """A bucket's directory is its parent (one look-up); a key file below a directory is that
    directory's; where one directory given lies within another, the first given that holds the file."""
    from audit.readers.buckets import StoredValue
    from audit.readers.offload_index import OffloadIndex

    outer, inner, other = tmp_path / "outer", tmp_path / "outer" / "inner", tmp_path / "other"

    def value(path: Path) -> StoredValue:
        return StoredValue(path, 0, 1, b"\0k", b"\0k")

    plain = OffloadIndex({}, {}, [other, inner])
    assert plain.directory_of(value(inner / "1.bucket")) == inner
    assert plain.directory_of(value(other / "ab" / "cd" / "key")) == other  # a file-per-key file, below its directory
    assert plain.directory_of(value(tmp_path / "elsewhere" / "2.bucket")) == tmp_path / "elsewhere"
    nested = OffloadIndex({}, {}, [outer, inner])
    assert nested.directory_of(value(inner / "1.bucket")) == outer
    assert OffloadIndex({}, {}, [inner, outer]).directory_of(value(inner / "1.bucket")) == inner
