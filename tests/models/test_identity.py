"""A base model's identity for an adapter loaded without ctxc (issue 54): what each kind of name
is, and what plain ``from_pretrained`` takes offline to load it."""

from __future__ import annotations

import hashlib
import json

from ctxc.models.identity import base_identity

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_a_gguf_file_is_its_folder_with_gguf_file_and_its_sha256(tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(200)))
    found = base_identity(str(gguf), str(tmp_path / "converted"))
    assert (found.kind, found.load_path, found.gguf_file) == ("gguf", str(tmp_path), "m.gguf")
    assert found.sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest(), found
    assert found.load_kwargs() == ', gguf_file="m.gguf"', found.load_kwargs()
    assert found.sha256 in found.describe(), found.describe()


def test_an_alias_is_its_repository_at_the_snapshot_commit(tmp_path) -> None:
    snapshot = tmp_path / "hub" / "models--google--gemma-3-1b-pt" / "snapshots" / COMMIT
    found = base_identity("gemma-3-1b", str(snapshot))
    assert (found.kind, found.load_path, found.revision) == ("hub", "google/gemma-3-1b-pt", COMMIT)
    assert found.resolves_to == "google/gemma-3-1b-pt" and found.load_kwargs() == "", found
    assert "ctxc's alias for" in found.describe(), found.describe()


def test_a_folder_is_itself_with_its_recorded_name_and_git_commit(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "org/model"}))
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".git" / "refs" / "heads" / "main").write_text(COMMIT + "\n")
    found = base_identity(str(tmp_path), str(tmp_path))
    assert (found.kind, found.load_path, found.gguf_file) == ("folder", str(tmp_path), None)
    assert (found.recorded_name, found.revision) == ("org/model", COMMIT), found
    bare = base_identity(str(tmp_path / "nothing"), str(tmp_path / "nothing"))
    assert bare.revision is None and "revision unknown" in bare.describe(), bare
    unnamed = base_identity("", "")  # not the working folder's config or git commit
    assert (unnamed.kind, unnamed.load_path, unnamed.revision) == ("unnamed", "", None), unnamed
