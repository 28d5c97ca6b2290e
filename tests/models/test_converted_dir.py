"""The converted-model cache key: one entry per GGUF file, however the path reaches it."""

from __future__ import annotations

import os

from ctxc.models.load import converted_dir


def test_a_linked_or_relative_path_maps_to_the_same_entry(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))
    real = tmp_path / "shared" / "gguf"
    real.mkdir(parents=True)
    (real / "m.gguf").write_bytes(b"GGUF" + bytes(60))
    linked = tmp_path / "private"
    linked.mkdir()
    (linked / "gguf").symlink_to(real, target_is_directory=True)
    monkeypatch.chdir(real)
    direct = converted_dir(real / "m.gguf")
    assert converted_dir(linked / "gguf" / "m.gguf") == direct
    assert converted_dir(real.joinpath("m.gguf").relative_to(real)) == direct
    assert direct.parent == tmp_path / "cache" / "converted"


def test_a_changed_file_gets_a_new_entry(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    before = converted_dir(gguf)
    gguf.write_bytes(b"GGUF" + bytes(61))  # another size
    assert converted_dir(gguf) != before
    stat = gguf.stat()
    os.utime(gguf, (stat.st_atime, stat.st_mtime + 10))  # another mtime
    assert converted_dir(gguf) != before
    assert len({before, converted_dir(gguf)}) == 2
