"""cppo.fileio: atomic writes that no planted file can redirect, and run metadata."""

import os

import pytest

from cppo import fileio


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "res.json"
    target.write_text("old")
    fileio.atomic_write(target, "new")
    assert target.read_text() == "new"
    fileio.atomic_write(target, b"bytes")
    assert target.read_bytes() == b"bytes"
    fileio.atomic_write(target, lambda f: f.write("from a writer"))
    assert target.read_text() == "from a writer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]  # no temporary left


def test_planted_symlinks_are_never_followed(tmp_path):
    """Symlinks at every name the old code used (``.tmp-NAME``, ``.NAME.partial``) point at a file of the user's:
    it is untouched, and the target becomes a regular file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name in (".tmp-res.json", ".res.json.partial", ".res.json.tmp"):
        os.symlink(victim, tmp_path / name)
    fileio.write_json(tmp_path / "res.json", {"a": float("nan"), "b": [1, float("inf")]})
    assert victim.read_text() == "precious"
    assert not (tmp_path / "res.json").is_symlink()
    assert (tmp_path / "res.json").read_text() == '{\n  "a": null,\n  "b": [\n    1,\n    null\n  ]\n}\n'


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("kept")

    def boom(f):
        f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        fileio.atomic_write(target, boom)
    assert target.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_run_metadata_names_commit_and_versions():
    meta = fileio.run_metadata(commit="abc123", argv=["x", "--y"])
    assert meta["git_commit"] == "abc123" and meta["git_dirty"] is None
    assert meta["argv"] == ["x", "--y"] and meta["python"] and meta["torch"]
    assert "cores" in meta["device_name"]


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    old = os.umask(0o022)
    try:
        fileio.atomic_write(tmp_path / "new.txt", "x")
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        (tmp_path / "kept.txt").write_text("y")
        os.chmod(tmp_path / "kept.txt", 0o640)
        fileio.atomic_write(tmp_path / "kept.txt", "z")
        assert (tmp_path / "kept.txt").stat().st_mode & 0o777 == 0o640  # a replaced file keeps its mode
    finally:
        os.umask(old)


def test_a_path_in_an_error_says_where_a_relative_one_was_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert fileio.shown_path("/abs/x.gguf") == "'/abs/x.gguf'"
    resolved = str(tmp_path.parent / "m" / "x.gguf")
    want = f"'../m/x.gguf' (resolved from the current directory {str(tmp_path)!r} to {resolved!r})"
    assert fileio.shown_path("../m/x.gguf") == want
