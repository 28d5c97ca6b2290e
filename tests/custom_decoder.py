"""A small decoder that is not from Transformers: its own module names, RMSNorm and SwiGLU.

ctxc must find its blocks from ops and data flow alone. Variants build the refusal cases of
MATH.md 5: a post norm with no trainable parameter, and an MoE whose gates can sum to 0.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ToyLM"]


class Rms(nn.Module):
    """RMS normalisation, with a trainable gain or (``trainable=False``) without one."""

    def __init__(self, width: int, trainable: bool = True) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width)) if trainable else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * self.gain if self.gain is not None else y


class SwiGlu(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w_a = nn.Linear(width, hidden, bias=False)
        self.w_b = nn.Linear(width, hidden, bias=False)
        self.w_o = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_o(F.silu(self.w_a(x)) * self.w_b(x))


class ReluRoutedExperts(nn.Module):
    """Top-k experts with ReLU routing weights (not renormalised): the gates can all be 0."""

    def __init__(self, width: int, hidden: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.route = nn.Linear(width, experts)
        self.bank_in = nn.Parameter(torch.randn(experts, 2 * hidden, width) / width**0.5)
        self.bank_out = nn.Parameter(torch.randn(experts, width, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])  # [T, d]
        weights, ids = torch.topk(torch.relu(self.route(rows)), self.top_k, dim=-1)
        ids, weights = ids.reshape(-1), weights.reshape(-1)  # [T * k]
        picked = rows.repeat_interleave(self.top_k, dim=0)  # [T * k, d]
        a, b = torch.bmm(self.bank_in[ids], picked.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(self.bank_out[ids], (F.silu(a) * b).unsqueeze(-1)).squeeze(-1)
        out = out * weights.unsqueeze(-1)
        return out.view(-1, self.top_k, shape[-1]).sum(dim=1).reshape(shape)


class Cell(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, mlp: str, post: str | None) -> None:
        super().__init__()
        self.heads = heads
        self.pre_mix = Rms(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.mix_out = nn.Linear(width, width, bias=False)
        self.pre_ffn = Rms(width)
        self.ffn = SwiGlu(width, hidden) if mlp == "swiglu" else ReluRoutedExperts(width, hidden)
        self.post_ffn = None if post is None else Rms(width, trainable=post == "scaled")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.pre_mix(x)).view(b, s, 3, self.heads, -1).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.mix_out(a.transpose(1, 2).reshape(b, s, d))
        out = self.ffn(self.pre_ffn(x))
        if self.post_ffn is not None:
            out = self.post_ffn(out)
        return x + out


class ToyLM(nn.Module):
    """``forward(input_ids=...)`` returns an object with ``.logits``, like a Transformers LM.

    Args:
        mlp: ``swiglu`` or ``experts`` (ReLU-routed top-2 of 4).
        post: None, ``scaled`` (a post-FFN RMS norm with a gain) or ``plain`` (without one:
            not output-controllable, MATH.md 5); or one of these per layer.
    """

    def __init__(
        self,
        vocab: int = 128,
        width: int = 64,
        layers: int = 2,
        heads: int = 4,
        hidden: int = 96,
        mlp: str = "swiglu",
        post: str | list[str | None] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(vocab, width)
        self.places = nn.Embedding(256, width)  # learned positions: the first block absorbs them
        posts = post if isinstance(post, list | tuple) else [post] * layers
        self.trunk = nn.ModuleList(Cell(width, heads, hidden, mlp, p) for p in posts)
        self.final = Rms(width)
        self.readout = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.ndim == 1:
                    p.normal_(1.0, 0.5)  # random gains, so every part matters
        self.eval()

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tokens(input_ids) + self.places(pos)[None]
        for cell in self.trunk:
            x = cell(x)
        return SimpleNamespace(logits=self.readout(self.final(x)))
