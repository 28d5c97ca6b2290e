"""An image in a chat context (issue 24): ``ctxc compile --chat --messages M --image IMG`` on a
tiny Gemma 3 VLM whose processor carries a chat template; the messages' ``{"type": "image"}``
part takes the image. ``model/`` fed the query turn gives the model's own multimodal forward on
the whole conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from testbed.tiny_vlms import build_vlm, make_image
from tests.fixtures.helpers import diff_msg, max_diff, run_cli

pytestmark = pytest.mark.tiny

# Gemma 3's layout over the tiny word vocabulary (its turn markers are words here: the tiny
# tokenizer knows no other), an image part as Gemma 3's template writes it: <start_of_image>.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ {'system': 'w100', 'user': 'w101', 'assistant': 'w102'}[m.role] }} "
    "{% if m.content is string %}{{ m.content }} {% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image> {% else %}{{ p.text }} {% endif %}"
    "{% endfor %}{% endif %}w103 {% endfor %}{% if add_generation_prompt %}w102 {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "w5 w6 w7"},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w8 w9 w10"}]},
    {"role": "assistant", "content": "w11 w12"},
    {"role": "user", "content": "w20 w21"},
]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-vlm")
    folder = build_vlm("gemma3", root / "gemma3")
    processor = AutoProcessor.from_pretrained(str(folder))
    processor.chat_template = TEMPLATE
    processor.save_pretrained(str(folder))
    (root / "m.json").write_text(json.dumps(MESSAGES))
    return {"folder": folder, "image": make_image(root / "a.png", 1), "messages": root / "m.json"}


def _whole_forward(folder: Path, image: Path, k: int) -> tuple[list[int], torch.Tensor]:
    """The template's ids for the whole conversation and the model's own forward on them."""
    from PIL import Image

    processor = AutoProcessor.from_pretrained(str(folder))
    text = processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    with Image.open(image) as img:
        enc = processor(
            text=text, images=[img.convert("RGB")], add_special_tokens=False, return_tensors="pt"
        )
    model = AutoModelForImageTextToText.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        logits = model(**enc).logits[0, -k:].float()
    return enc["input_ids"][0].tolist(), logits


def test_compile_chat_with_an_image(vlm, tmp_path) -> None:
    run = run_cli(
        "compile", "--chat", "--messages", str(vlm["messages"]), "--image", str(vlm["image"]),
        "--model", str(vlm["folder"]), "--out", "out", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["images"]["image_tokens"] == 4
    assert report["chat"]["query_text"] == "w101 w20 w21 w103 w102 "
    ids, want = _whole_forward(vlm["folder"], vlm["image"], len(report["query_ids"]))
    assert ids == report["context_ids"] + report["query_ids"]
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out" / "model")).eval()
    with torch.no_grad():
        got = model(input_ids=torch.tensor([report["query_ids"]])).logits[0].float()
    assert max_diff(got, want) <= 2e-5, diff_msg("model/ fed the query turn", got, want)
    assert report["control"]["max_abs_logit_diff"] > 1e-2, report["control"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image", "IMG", "--image", "IMG"], "2 image(s) for 1 image part(s)"),
        ([], "0 image(s) for 1 image part(s)"),
    ],
)
def test_images_and_image_parts_must_match(vlm, tmp_path, args, message) -> None:
    args = [str(vlm["image"]) if a == "IMG" else a for a in args]
    run = run_cli(
        "compile", "--chat", "--messages", str(vlm["messages"]), *args,
        "--model", str(vlm["folder"]), "--out", "out", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [f"ctxc: error: {message} in the context's messages"]
    assert not (tmp_path / "out").exists()


def test_chat_image_needs_messages(vlm, tmp_path) -> None:
    (tmp_path / "s.txt").write_text("w5 w6")
    run = run_cli(
        "compile", "--chat", "--system", "s.txt", "--query", "w20", "--image", str(vlm["image"]),
        "--model", str(vlm["folder"]), "--out", "out", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.startswith("ctxc: error: with --chat, --image takes --messages")
