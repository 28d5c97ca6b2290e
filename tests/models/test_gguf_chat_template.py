"""A GGUF's chat template, which Transformers' GGUF loader leaves out (issue 24): read from its
metadata at the conversion."""

from __future__ import annotations

import pytest

from ctxc.core.errors import CtxcError
from ctxc.models.load import gguf_chat_template
from testbed.chat import template

pytestmark = pytest.mark.tiny


def _gguf(path, chat_template: str | None):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_template_in_a_gguf_is_read(tmp_path) -> None:
    text = template("gemma3")
    assert gguf_chat_template(_gguf(tmp_path / "a.gguf", text)) == text
    assert gguf_chat_template(_gguf(tmp_path / "b.gguf", None)) is None


def test_not_a_gguf_is_one_line(tmp_path) -> None:
    path = tmp_path / "c.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(CtxcError, match="cannot read GGUF file"):
        gguf_chat_template(path)
