"""llama.cpp's names and layouts for a Transformers model's tensors (the GGUF writers' map).

Transformers' GGUF loader (``modeling_gguf_pytorch_utils.get_gguf_hf_weights_map``) maps a
GGUF tensor to a Transformers parameter with gguf-py's ``TensorNameMap`` and then undoes what
llama.cpp's ``convert_hf_to_gguf.py`` did to it (its ``TensorProcessor`` classes): Llama's
``attn_q``/``attn_k`` rows are permuted for llama.cpp's RoPE layout
(``LlamaTensorProcessor._reverse_permute_weights``), and Gemma's RMS norms are stored as
``1 + weight`` (``Gemma2TensorProcessor``, used for Gemma 3 too). The writers here do the
forward direction, with the same ``TensorNameMap``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ctxc.core.errors import CtxcError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["GgufArch", "gguf_arch", "gguf_name", "gguf_tensors"]


@dataclass(frozen=True)
class GgufArch:
    """How one Transformers model type is written.

    Attributes:
        model_type: Transformers' ``config.model_type``.
        arch: llama.cpp's ``general.architecture``.
        permute_qk: ``attn_q``/``attn_k`` rows are stored in llama.cpp's RoPE order.
        norm_plus_one: RMS norm weights are stored as ``1 + weight`` (Gemma).
    """

    model_type: str
    arch: str
    permute_qk: bool = False
    norm_plus_one: bool = False


# The architectures whose round trip through Transformers' GGUF loader ctxc checks
# (tests/backends/test_backend_gguf.py: Llama and Gemma 2 tiny, Gemma 3 270M bundled).
_ARCHS = {
    a.model_type: a
    for a in (
        GgufArch("llama", "llama", permute_qk=True),
        GgufArch("mistral", "llama", permute_qk=True),
        GgufArch("qwen2", "qwen2"),
        GgufArch("qwen3", "qwen3"),
        GgufArch("gemma2", "gemma2", norm_plus_one=True),
        GgufArch("gemma3_text", "gemma3", norm_plus_one=True),
    )
}


def gguf_arch(model: torch.nn.Module) -> GgufArch:
    """The GGUF architecture of ``model``.

    Raises:
        CtxcError: ctxc's GGUF writer does not know the model's type (a one-line usage error).
    """
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in _ARCHS:
        raise CtxcError(
            f"the GGUF writer does not know model type {model_type!r}; it writes "
            f"{', '.join(sorted(_ARCHS))} (use --emit torch, onnx or peft)"
        )
    return _ARCHS[model_type]


def gguf_name(arch: GgufArch, layers: int, param: str) -> str | None:
    """llama.cpp's tensor name of a Transformers parameter (``blk.3.ffn_down.weight``), or None.

    Args:
        arch: the architecture.
        layers: the model's ``num_hidden_layers``.
        param: the parameter's ``state_dict`` name.
    """
    stem, _, suffix = param.rpartition(".")
    found = _name_map(arch.arch, layers).get_name(stem)
    return None if found is None else f"{found}.{suffix}"


@functools.cache
def _name_map(arch: str, layers: int):
    """gguf-py's ``TensorNameMap`` (slow to build: once per architecture and depth)."""
    import gguf

    key = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(key, layers)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: rows (head, 2, half) -> (head, half, 2).
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def gguf_tensors(model: PreTrainedModel, arch: GgufArch) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of ``model`` under its llama.cpp name and layout, float32.

    A tied output projection is left out (Transformers' loader ties it back when ``output`` is
    missing). Side effects: none; ``model`` is only read.

    Raises:
        CtxcError: a parameter with no llama.cpp name.
    """
    cfg = model.config
    layers = cfg.num_hidden_layers
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for param, value in model.state_dict().items():
        if tied and param == "lm_head.weight":
            continue
        name = gguf_name(arch, layers, param)
        if name is None:
            raise CtxcError(f"the GGUF writer has no llama.cpp name for {param}")
        w = value.detach().float().cpu().numpy()
        if arch.permute_qk and ".attn_q." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif arch.permute_qk and ".attn_k." in name:
            w = _permute(w, cfg.num_key_value_heads)
        elif arch.norm_plus_one and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        yield name, np.ascontiguousarray(w)
