"""How well a thought patch stands in for its context on queries (issue 13, Evaluation).

For each query ``q`` the patched model is fed ``prefix + q`` (no context) and compared with the
original model fed ``context + q`` at every position of the patched input: mean KL(full ||
patched) per token, top-1 agreement, and free generation: greedy tokens from each, counted until
the first difference. Without a patch the same figures are the unpatched control's.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from ctxc.bake_data import FitData
from ctxc.patch import Patch

__all__ = ["BakeEval", "evaluate", "evaluate_many", "greedy", "position_figures"]


@dataclass(frozen=True)
class BakeEval:
    """Figures of a patched model (or the control) on a set of queries.

    Attributes:
        queries: how many queries.
        positions: how many positions were compared.
        kl: mean KL(full-context || patched) per position, nats.
        top1: fraction of positions whose argmax agrees.
        matched: mean greedy tokens generated before the first difference (of ``gen_tokens``).
        gen_tokens: tokens generated per query (0: no generation).
        matched_all: each query's matched tokens.
    """

    queries: int
    positions: int
    kl: float
    top1: float
    matched: float
    gen_tokens: int
    matched_all: list[int]

    def to_dict(self) -> dict:
        return asdict(self)


def position_figures(
    patched: torch.Tensor, full: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(full || patched) and top-1 agreement at each position.

    Args:
        patched: logits [k, vocab].
        full: the full-context logits [k, vocab].

    Returns:
        (kl [k] float64, agree [k] bool).
    """
    lp = patched.double().log_softmax(-1)  # [k, vocab]
    lf = full.double().log_softmax(-1)  # [k, vocab]
    kl = (lf.exp() * (lf - lp)).sum(-1)  # [k]
    return kl, patched.argmax(-1) == full.argmax(-1)


def greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids`` (KV cache, no sampling)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    got: list[int] = []
    for _ in range(steps):
        tok = int(out.logits[0, -1].argmax())
        got.append(tok)
        nxt = torch.tensor([[tok]], device=device)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return got


def _matched(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def evaluate(
    model: torch.nn.Module,
    patch: Patch | None,
    data: FitData,
    gen_tokens: int = 32,
    on_query=None,
) -> BakeEval:
    """The figures of ``model`` with ``patch`` applied (None: the unpatched control) on
    ``data``'s queries; the model is left as it was.

    Args:
        model: the unpatched model the patch was computed on.
        patch: the thought patch, or None.
        data: the context and the queries.
        gen_tokens: greedy tokens per query for the free-generation figure (0: skip).
        on_query: progress callback ``(done, total)``.

    Returns:
        the :class:`BakeEval`.
    """
    return evaluate_many(model, [patch], data, gen_tokens, on_query)[0]


def evaluate_many(
    model: torch.nn.Module,
    patches: list[Patch | None],
    data: FitData,
    gen_tokens: int = 32,
    on_query=None,
) -> list[BakeEval]:
    """:func:`evaluate` for several patches (None: the control), sharing the full-context runs.

    Returns:
        one :class:`BakeEval` per patch, in order.
    """
    device = next(model.parameters()).device
    figs: list[tuple[list, list, list[int]]] = [([], [], []) for _ in patches]
    n = len(data.queries)
    with torch.no_grad():
        for i in range(n):
            # The original with the context first, then each patch applied for the query alone:
            # one query's full-vocabulary logits in memory at a time.
            full_ids, ids = data.full(i), data.reduced(i)
            x = torch.tensor([full_ids], device=device)
            full = model(input_ids=x, logits_to_keep=len(ids)).logits[0].float().cpu()
            want = greedy(model, full_ids, gen_tokens) if gen_tokens else []
            for patch, (kls, agrees, matched) in zip(patches, figs, strict=True):
                applied = patch.applied(model, check=False) if patch else contextlib.nullcontext()
                with applied:
                    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]
                    got = greedy(model, ids, gen_tokens) if gen_tokens else []
                kl, agree = position_figures(logits.float().cpu(), full)
                kls.append(kl)
                agrees.append(agree)
                matched.append(_matched(got, want))
            if on_query is not None:
                on_query(i + 1, n)
    return [_summarise(kls, agrees, matched, gen_tokens) for kls, agrees, matched in figs]


def _summarise(kls: list, agrees: list, matched: list[int], gen_tokens: int) -> BakeEval:
    kl_all, agree_all = torch.cat(kls), torch.cat(agrees)
    return BakeEval(
        queries=len(matched),
        positions=int(kl_all.numel()),
        kl=float(kl_all.mean()),
        top1=float(agree_all.double().mean()),
        matched=float(sum(matched) / max(len(matched), 1)),
        gen_tokens=gen_tokens,
        matched_all=matched,
    )
