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
