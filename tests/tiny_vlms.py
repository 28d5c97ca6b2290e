"""Tiny random vision-language models with their processors, saved to a folder (no download).

Three families: Gemma 3 (``Gemma3ForConditionalGeneration``: SigLIP tower, pooled projector,
bidirectional attention over image tokens), LLaVA (``LlavaForConditionalGeneration``: CLIP
tower, MLP projector, a Llama language model) and PaliGemma (``PaliGemmaForConditionalGeneration``:
SigLIP tower, a Gemma 1 language model whose config asks for bidirectional attention, so the
prefix of image and prompt tokens attends both ways, and Transformers' default SDPA path attends
both ways over a text-only input too). Each folder holds the model, a word-level
tokenizer over the tiny vocabulary with the family's image tokens as special tokens, and the
family's processor with 28-pixel images, so ``ctxc.load_model(folder)`` and
``AutoProcessor.from_pretrained(folder)`` load them as a real checkpoint would load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers.processors import TemplateProcessing

__all__ = ["VLM_FAMILIES", "build_qwen2_vl", "build_vlm", "make_image"]

VOCAB = 128
_IMAGE = 28  # pixels per side; 7-pixel patches
_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # a wide init, so that the context (and the image) matters
)
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=_IMAGE,
    patch_size=7,
)
_GEMMA3_SPECIALS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
_LLAVA_SPECIALS = {"image_token": "<image>"}
_PALIGEMMA_SPECIALS = {"image_token": "<image>"}


def _tokenizer(specials: dict[str, str]) -> tf.PreTrainedTokenizerFast:
    """Word-level, whitespace-split, ``<bos>`` first; the image tokens are the last ids."""
    extra = list(specials.values())
    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4 - len(extra))]
    core = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words + extra)}, unk_token="<unk>")
    )
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
    )
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens=specials,
    )


def _gemma3(seed: int):
    tok = _tokenizer(_GEMMA3_SPECIALS)
    processor = tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessorPil(size={"height": _IMAGE, "width": _IMAGE}),
        tokenizer=tok,
        image_seq_length=4,
    )
    text = tf.Gemma3TextConfig(
        **_TEXT,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=tf.SiglipVisionConfig(**_VISION),
        mm_tokens_per_image=4,  # 16 patches pooled 2x2
        boi_token_index=tok.convert_tokens_to_ids(_GEMMA3_SPECIALS["boi_token"]),
        eoi_token_index=tok.convert_tokens_to_ids(_GEMMA3_SPECIALS["eoi_token"]),
        image_token_index=tok.convert_tokens_to_ids(_GEMMA3_SPECIALS["image_token"]),
    )
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # Gemma 3 initialises its projector to zero: every image would vanish
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    return model, processor


def _llava(seed: int):
    tok = _tokenizer(_LLAVA_SPECIALS)
    processor = tf.LlavaProcessor(
        image_processor=tf.CLIPImageProcessorPil(
            size={"shortest_edge": _IMAGE}, crop_size={"height": _IMAGE, "width": _IMAGE}
        ),
        tokenizer=tok,
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
    )
    config = tf.LlavaConfig(
        text_config=tf.LlamaConfig(**_TEXT),
        vision_config=tf.CLIPVisionConfig(**_VISION, projection_dim=32, initializer_factor=5.0),
        image_token_index=tok.convert_tokens_to_ids(_LLAVA_SPECIALS["image_token"]),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    return tf.LlavaForConditionalGeneration(config), processor


def _paligemma(seed: int):
    tok = _tokenizer(_PALIGEMMA_SPECIALS)
    images = tf.SiglipImageProcessorPil(size={"height": _IMAGE, "width": _IMAGE})
    images.image_seq_length = 16  # 28 / 7 squared: every patch is an image token
    processor = tf.PaliGemmaProcessor(image_processor=images, tokenizer=tok)
    vocab = len(processor.tokenizer)  # the processor adds its location and segment tokens
    config = tf.PaliGemmaConfig(
        text_config=tf.GemmaConfig(**{**_TEXT, "vocab_size": vocab}, head_dim=16),
        vision_config=tf.SiglipVisionConfig(**_VISION, projection_dim=64),
        image_token_index=processor.image_token_id,
        projection_dim=64,
        hidden_size=64,
        vocab_size=vocab,
    )
    torch.manual_seed(seed)
    return tf.PaliGemmaForConditionalGeneration(config), processor


VLM_FAMILIES = {"gemma3": _gemma3, "llava": _llava, "paligemma": _paligemma}


def build_vlm(family: str, folder: Path, seed: int = 0) -> Path:
    """Build a tiny random VLM of ``family`` and save it with its processor into ``folder``.

    Returns:
        ``folder``, loadable by ``ctxc.load_model`` and ``AutoProcessor.from_pretrained``.
    """
    model, processor = VLM_FAMILIES[family](seed)
    model.eval()
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return folder


def build_qwen2_vl(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen2-VL saved as a real checkpoint is: its processor configs name Transformers'
    default image and video processors, which import torchvision (the processor objects are
    not built here, so that this works without torchvision).

    Returns:
        ``folder``.
    """
    import json

    specials = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    }
    tok = _tokenizer(specials)
    rope = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0}
    config = tf.Qwen2VLConfig(
        text_config=dict(_TEXT, rope_parameters=rope),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14),
        image_token_id=tok.convert_tokens_to_ids(specials["image_token"]),
        video_token_id=tok.convert_tokens_to_ids(specials["video_token"]),
        vision_start_token_id=tok.convert_tokens_to_ids(specials["vision_start_token"]),
    )
    torch.manual_seed(seed)
    tf.Qwen2VLForConditionalGeneration(config).eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    common = dict(processor_class="Qwen2VLProcessor", patch_size=14, merge_size=2)
    common.update(min_pixels=784, max_pixels=3136, temporal_patch_size=2)
    for name, key, cls in [
        ("preprocessor_config.json", "image_processor_type", "Qwen2VLImageProcessor"),
        ("video_preprocessor_config.json", "video_processor_type", "Qwen2VLVideoProcessor"),
    ]:
        (folder / name).write_text(json.dumps({**common, key: cls}))
    return folder


def make_image(path: Path, seed: int, size: tuple[int, int] = (40, 52)) -> Path:
    """A seeded random RGB picture (noise over a gradient) written as PNG or JPEG by suffix."""
    rng = np.random.default_rng(seed)
    h, w = size
    ramp = np.linspace(0, 255, w)[None, :, None] * rng.random(3)[None, None, :]
    pixels = np.clip(ramp + rng.normal(0, 60, (h, w, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path
