"""The converted-model cache key: one entry per GGUF file, however the path reaches it."""

from __future__ import annotations

import os

from ctxc.models.load import converted_dir, source_gguf


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


def test_a_model_not_from_the_cache_is_not_the_bundled_one_and_converts_nothing(
    tmp_path, monkeypatch
) -> None:
    # `--emit gguf` of a tiny Llama asked whether it was the bundled Gemma by converting Gemma
    # first: a minute and 1 GB in a new cache (caught by the tier check in a clean CI run).
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))

    class Named:
        name_or_path = str(tmp_path / "llama")

    (tmp_path / "llama").mkdir()
    assert source_gguf(Named()) is None
    assert not (tmp_path / "cache").exists(), sorted(p.name for p in tmp_path.rglob("*"))
