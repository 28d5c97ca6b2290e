"""Image contexts on tiny random vision-language models (issue 12): exactness, per image.

The reference is independent of ctxc's graphs: the model's own Transformers forward fed the
processor's output for the images and the text, plus the query. The emitted model is the folder
``emit_torch`` writes, reloaded by plain ``AutoModelForImageTextToText`` and fed the query ids
alone. Each figure stands beside the unpatched control's, which must be far off (the test could
fail).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.generate.steps import generate
from ctxc.models.images import encode_image_context, prefill_inputs
from testbed.tiny_vlms import build_vlm, make_image
from tests.fixtures.helpers import diff_msg, max_diff

pytestmark = pytest.mark.tiny

TEXT = "w5 w6 w7 w8 w9 w10"
QUERY = "w20 w21 w22"
EXACT = 1e-5
FAR = 1e-2  # the unpatched control is at least this far off: the image and text matter


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlms")
    images = [make_image(root / "a.png", 1), make_image(root / "b.jpg", 2, (36, 30))]
    loaded = {}
    for family in ("gemma3", "llava", "paligemma"):
        folder = build_vlm(family, root / family)
        model, _ = ctxc.load_model(str(folder))
        loaded[family] = (model, AutoProcessor.from_pretrained(str(folder)), folder)
    return {"models": loaded, "images": images, "root": root}


def _reference(model, processor, text: str, images: list, query: str | None) -> torch.Tensor:
    """The model's own forward on the processor's output (+ the query ids): [k, vocab]."""
    placeholder = processor.image_token * len(images)
    enc = processor(
        text=f"{placeholder}\n{text}" if text else placeholder,
        images=[_rgb(p) for p in images],
        return_tensors="pt",
    )
    ids = enc["input_ids"]
    k = 1
    if query is not None:
        q = torch.tensor([processor.tokenizer(query, add_special_tokens=False).input_ids])
        k = q.shape[1]
        for key in list(enc):
            value = enc[key]
            if isinstance(value, torch.Tensor) and value.shape[:2] == ids.shape:
                fill = q if key == "input_ids" else torch.full_like(q, int(key == "attention_mask"))
                enc[key] = torch.cat([value, fill.to(value.dtype)], dim=1)
    with torch.no_grad():
        return model(**enc).logits[0, -k:].float()


def _rgb(path: Path):
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


def _emitted(model, processor, result, out: Path) -> torch.Tensor:
    """The written model folder, reloaded by plain Transformers, fed the query ids alone."""
    emit_torch(model, processor, result.patch, out)
    reloaded = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    with torch.no_grad():
        return reloaded(input_ids=torch.tensor([result.patch.meta.query_ids])).logits[0].float()


def _control(model, result) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([result.patch.meta.query_ids])).logits[0].float()


# PaliGemma: the prefix attends both ways, and so does the default SDPA path over the query alone
# (its config's use_bidirectional_attention): a three-token query tells it from causal.
@pytest.mark.parametrize("family", ["gemma3", "llava", "paligemma"])
def test_image_and_text_context_is_exact(vlms, family, tmp_path) -> None:
    model, processor, _ = vlms["models"][family]
    image = vlms["images"][0]
    result = ctxc.compile(model, processor, context=TEXT, query=QUERY, images=[image])
    want = _reference(model, processor, TEXT, [image], QUERY)
    got = _emitted(model, processor, result, tmp_path / "model")
    control = _control(model, result)
    assert max_diff(got, want) <= EXACT, diff_msg(f"{family} emitted", got, want)
    assert max_diff(control, want) > FAR, diff_msg(f"{family} control", control, want)
    assert result.report.images["image_tokens"] > 0
    assert result.report.images["full_run_vs_model"] == 0.0, result.report.images
    assert torch.equal(result.full_logits, want), diff_msg("reference", result.full_logits, want)
    # Only the language model's blocks are patched: the vision tower and projector are not.
    decoder = result.report.images["language_model"]
    assert result.patch.deltas and all(n.startswith(decoder + ".") for n in result.patch.deltas)


def test_image_only_context_is_exact(vlms, tmp_path) -> None:
    model, processor, _ = vlms["models"]["gemma3"]
    image = vlms["images"][1]
    result = ctxc.compile(model, processor, images=[image])  # no text, no query: last token
    want = _reference(model, processor, "", [image], None)
    got = _emitted(model, processor, result, tmp_path / "model")
    control = _control(model, result)
    assert max_diff(got, want) <= EXACT, diff_msg("image-only emitted", got, want)
    assert max_diff(control, want) > FAR, diff_msg("image-only control", control, want)


def test_two_images_in_place_of_the_placeholders(vlms) -> None:
    model, processor, _ = vlms["models"]["llava"]
    a, b = vlms["images"]
    text = f"w5 {processor.image_token} w6 w7 {processor.image_token} w8"
    result = ctxc.compile(model, processor, context=text, query=QUERY, images=[a, b])
    enc = processor(text=text, images=[_rgb(a), _rgb(b)], return_tensors="pt")
    assert result.patch.meta.context_ids == enc["input_ids"][0].tolist()
    assert result.report.emitted.max_abs_logit_diff <= EXACT, result.report.emitted
    assert result.report.control.max_abs_logit_diff > FAR, result.report.control


def test_a_different_image_gives_its_own_patch(vlms) -> None:
    model, processor, _ = vlms["models"]["gemma3"]
    runs = []
    for image in vlms["images"]:
        result = ctxc.compile(model, processor, context=TEXT, query=QUERY, images=[image])
        want = _reference(model, processor, TEXT, [image], QUERY)
        with torch.no_grad(), result.patch.applied(model):
            got = model(input_ids=torch.tensor([result.patch.meta.query_ids])).logits[0].float()
        assert max_diff(got, want) <= EXACT, diff_msg("own image", got, want)
        runs.append((result, want, got))
    (ra, wa, ga), (rb, wb, gb) = runs
    assert ra.patch.meta.context_ids == rb.patch.meta.context_ids  # same tokens, other pixels
    assert max_diff(wa, wb) > FAR, diff_msg("the two images' full logits", wa, wb)
    assert max_diff(ga, wb) > FAR, diff_msg("patch A against image B", ga, wb)
    assert max_diff(gb, wa) > FAR, diff_msg("patch B against image A", gb, wa)
    # The patches themselves differ: the largest change between their patched weights.
    assert ra.patch.deltas.keys() == rb.patch.deltas.keys()
    moved = max(
        max_diff(
            ra.patch.deltas[n].materialize(model.get_parameter(n)),
            rb.patch.deltas[n].materialize(model.get_parameter(n)),
        )
        for n in ra.patch.deltas
    )
    assert moved > FAR, f"the two images' patched weights differ by at most {moved:.3g}"


def test_generate_with_an_image_matches_every_step(vlms) -> None:
    model, processor, _ = vlms["models"]["gemma3"]
    image = encode_image_context(model, processor, TEXT, [vlms["images"][0]], None)
    ids = image.context_ids + image.query_ids
    steps = 5
    result = generate(model, ids, steps, apply="baked", prefill=prefill_inputs(image))
    assert all(s.match for s in result.steps), [s.max_abs_logit_diff for s in result.steps]
    assert max(s.max_abs_logit_diff for s in result.steps) <= EXACT
    # The baseline is the model with the image: Transformers' own greedy generation agrees.
    with torch.no_grad():
        greedy = model.generate(**image.inputs, max_new_tokens=steps, do_sample=False)
    assert [s.baseline_token for s in result.steps] == greedy[0, len(ids) :].tolist()
