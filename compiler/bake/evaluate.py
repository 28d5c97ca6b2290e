"""How well a thought patch stands in for its context on queries (issue 13, Evaluation).

For each query ``q`` the patched model is fed ``prefix + q`` (no context) and compared with the
original model fed ``context + q`` at every position of the patched input: mean KL(full ||
patched) per token, top-1 agreement, and free generation: greedy tokens from each, counted until
the first difference. Without a patch the same figures are the unpatched control's.

The original model's side (the :class:`Reference`) is computed once per query set and reused by
every patch: the context is run once and its KV cache continued by each query, and its greedy
continuation is kept as tokens. A patch then costs one forward per query, batched: the patched
model fed ``prefix + q + g[:-1]`` (``g`` the reference's greedy tokens) gives the KL/top-1
positions and, at each generated position, the token the patched model would pick. By causality
its free greedy generation equals ``g`` exactly up to the first position where that pick differs,
so the matched count is the leading run of agreements (up to rounding at a near-tie, as between
any two runs). Memory: one batch's logits and the reference's float32 logits at the compared
positions (1 MiB per position for a 262k vocabulary); :func:`evaluate_many` holds one chunk of
queries' reference at a time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ctxc.bake.data import FitData
from ctxc.models.kv_cache import cache_of, with_cache
from ctxc.patch import Patch

__all__ = [
    "BakeEval",
    "Reference",
    "answer_lengths",
    "chunks",
    "evaluate",
    "evaluate_against",
    "evaluate_many",
    "evaluate_scoped",
    "greedy",
    "log_probabilities",
    "position_figures",
    "reference",
]

_BATCH = 4  # patched queries per forward: 4 x 64 positions x 1 MiB of logits for Gemma 3
_CHUNK = 8  # queries whose reference evaluate_many holds at a time


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
        answers: the share of queries whose greedy answer equals the full-context model's
            through its first sentence (:func:`answer_lengths`); None without a tokenizer.
    """

    queries: int
    positions: int
    kl: float
    top1: float
    matched: float
    gen_tokens: int
    matched_all: list[int]
    answers: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Reference:
    """The original model fed the context, on a set of queries: computed once, reused.

    Attributes:
        data: the context and the queries.
        gen_tokens: greedy tokens kept per query.
        logits: per query, the full-context logits at the patched input's matched positions
            (its last ``data.matched(i)``: every one but an opening's unmatched) [m, vocab],
            float32.
        tokens: per query, its greedy continuation (``gen_tokens`` ids).
        answer_len: per query, the tokens of its first sentence (:func:`answer_lengths`), or
            None without a tokenizer.
    """

    data: FitData
    gen_tokens: int
    logits: tuple[torch.Tensor, ...]
    tokens: tuple[tuple[int, ...], ...]
    answer_len: tuple[int, ...] | None = None


_SENTENCE_ENDS = (".", "?", "!", "\n")


def answer_lengths(tokenizer, tokens: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Per greedy continuation, how many tokens its first sentence takes: up to the first
    token after which the text (leading white space dropped) holds ``.``, ``?``, ``!`` or a
    newline; all of them when none does (then the answer is its first ``gen_tokens``)."""
    out = []
    for toks in tokens:
        n = len(toks)
        for j in range(len(toks)):
            text = tokenizer.decode(list(toks[: j + 1]), skip_special_tokens=True).lstrip()
            if any(e in text for e in _SENTENCE_ENDS):
                n = j + 1
                break
        out.append(n)
    return tuple(out)


def position_figures(
    patched: torch.Tensor, full: torch.Tensor, full_logprobs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(full || patched) and top-1 agreement at each position.

    The log-probabilities are float32 and each position's sum float64: against float64 all
    through, the KL moves by at most about 2e-5 (a bake's KL is 0.01-3, printed to three
    places) at 2.5x the speed, and equal inputs still give exactly 0. Over Gemma 3's 262,144
    tokens, float64 took 11% of a default bake's time (py-spy, issue 55).

    Args:
        patched: logits [k, vocab].
        full: the full-context logits [k, vocab], or their log-probabilities with
            ``full_logprobs`` (:func:`log_probabilities`, computed once for several patches).

    Returns:
        (kl [k] float64, agree [k] bool).
    """
    lp = patched.float().log_softmax(-1)  # [k, vocab]
    lf = full.float() if full_logprobs else full.float().log_softmax(-1)  # [k, vocab]
    kl = F.kl_div(lp, lf, log_target=True, reduction="none").double().sum(-1)  # [k]
    return kl, patched.argmax(-1) == full.argmax(-1)


def log_probabilities(ref: Reference) -> Reference:
    """``ref`` with each query's logits replaced by their log-probabilities (float32): what
    :func:`position_figures` takes with ``full_logprobs``, computed once per query however
    many patches are measured against it."""
    return dataclasses.replace(ref, logits=tuple(x.float().log_softmax(-1) for x in ref.logits))


def greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids`` (KV cache, no sampling)."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    return _continue(model, out, steps)


def _continue(model: torch.nn.Module, out, steps: int) -> list[int]:
    """Greedy tokens from a forward's output (its last logits and its cache)."""
    return _continue_batch(model, out, steps)[0]


def _continue_batch(model: torch.nn.Module, out, steps: int) -> list[list[int]]:
    """Greedy tokens of every row of a batched forward's output (its last logits, its cache)."""
    device = next(model.parameters()).device
    got: list[torch.Tensor] = []
    for i in range(steps):
        tok = out.logits[:, -1].argmax(-1)  # [b]
        got.append(tok.cpu())
        if i + 1 < steps:
            out = model(
                input_ids=tok[:, None].to(device),
                **with_cache(model, cache_of(out)),
                use_cache=True,
                logits_to_keep=1,
            )
    rows = out.logits.shape[0]
    return torch.stack(got, 1).tolist() if got else [[] for _ in range(rows)]


def reference(
    model: torch.nn.Module, data: FitData, gen_tokens: int = 32, on_query=None, tokenizer=None
) -> Reference:
    """The original model fed ``context + q`` for each query: logits and greedy tokens.

    The context runs once; queries of equal length continue a copy of its KV cache together,
    batched (the same computation as the full input, up to rounding), greedy generation too.
    Without generation every query goes in one batch, right-padded (a causal model's earlier
    positions never see the padding after them).

    Args:
        model: the unpatched model.
        data: the context and the queries.
        gen_tokens: greedy tokens per query (0: none).
        on_query: progress callback ``(done, total)``.
        tokenizer: gives the answers' first sentences (:attr:`Reference.answer_len`).
    """
    device = next(model.parameters()).device
    p, n = data.head, len(data.queries)  # the prefix positions matched to the context's
    logits: list = [None] * n
    tokens: list = [None] * n
    groups: dict[int, list[int]] = {}
    # Each query continues the context with what is shown before it (FitData.shown), then itself.
    rows = [data.shown_before(i) + q for i, q in enumerate(data.queries)]
    for i, row in enumerate(rows):
        groups.setdefault(len(row) if gen_tokens else 0, []).append(i)
    done = 0
    with torch.no_grad():
        ctx = torch.tensor([data.context_ids], device=device)
        first = model(input_ids=ctx, use_cache=True, logits_to_keep=max(p, 1))
        head = first.logits[0, first.logits.shape[1] - p :].float().cpu()  # [p, vocab]
        for idx in groups.values():
            cache = copy.deepcopy(cache_of(first))
            cache.batch_repeat_interleave(len(idx))
            width = max(len(rows[i]) for i in idx)
            x = [rows[i] + [0] * (width - len(rows[i])) for i in idx]
            out = model(
                input_ids=torch.tensor(x, device=device), **with_cache(model, cache), use_cache=True
            )
            # The patched input's matched positions: the full input's last p before the query
            # (the context's, or the shown text's), then every query position.
            for j, i in enumerate(idx):
                k, shown = len(data.queries[i]), len(rows[i]) - len(data.queries[i])
                if shown:
                    logits[i] = out.logits[j, shown - p : shown + k].float().cpu()
                else:
                    logits[i] = torch.cat([head, out.logits[j, :k].float().cpu()])
            for j, toks in enumerate(_continue_batch(model, out, gen_tokens)):
                tokens[idx[j]] = tuple(toks)
            done += len(idx)
            if on_query is not None:
                on_query(done, n)
    lengths = answer_lengths(tokenizer, tuple(tokens)) if tokenizer and gen_tokens else None
    return Reference(data, gen_tokens, tuple(logits), tuple(tokens), lengths)


def _matched(picks: list[int], want: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(picks, want, strict=False):
        if x != y:
            break
        n += 1
    return n


# Per query: (kl [k], agree [k], generated tokens matched, first sentence matched or None).
_Figures = tuple[torch.Tensor, torch.Tensor, int, bool | None]


def _query_figures(
    model: torch.nn.Module, patch: Patch | None, ref: Reference, batch: int, logprobs: bool = False
) -> list[_Figures]:
    """Per query (kl [k], agree [k], matched) of the model with ``patch`` (``logprobs``:
    ``ref`` holds :func:`log_probabilities`)."""
    device = next(model.parameters()).device
    data, gen = ref.data, ref.gen_tokens
    rows = [
        data.reduced(i) + list(ref.tokens[i][: max(gen - 1, 0)]) for i in range(len(ref.tokens))
    ]
    applied = patch.applied(model, check=False) if patch is not None else contextlib.nullcontext()
    found: list[_Figures] = []
    with torch.no_grad(), applied:
        for start in range(0, len(rows), batch):
            group = rows[start : start + batch]
            width = max(len(r) for r in group)
            # Right padding: a causal model's earlier positions never see the padding.
            x = torch.tensor([r + [0] * (width - len(r)) for r in group], device=device)
            out = model(input_ids=x).logits.float().cpu()  # [b, width, vocab]
            for j in range(len(group)):
                i, k = start + j, len(data.reduced(start + j))
                m = ref.logits[i].shape[0]  # the last m positions have a reference
                kl, agree = position_figures(out[j, k - m : k], ref.logits[i], logprobs)
                picks = out[j, k - 1 : k - 1 + gen].argmax(-1).tolist() if gen else []
                m = _matched(picks, ref.tokens[i])
                answer = None if ref.answer_len is None else m >= ref.answer_len[i]
                found.append((kl, agree, m, answer))
            del out
    return found


def evaluate_against(
    model: torch.nn.Module, patch: Patch | None, ref: Reference, batch: int = _BATCH
) -> BakeEval:
    """The figures of ``model`` with ``patch`` (None: the control) against a reference.

    Args:
        model: the unpatched model the patch was computed on (left as it was).
        patch: the thought patch, or None.
        ref: the :class:`Reference` of the queries.
        batch: queries per forward.
    """
    found = _query_figures(model, patch, ref, batch)
    return _summarise(found, gen_tokens=ref.gen_tokens)


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
    tokenizer=None,
) -> list[BakeEval]:
    """:func:`evaluate` for several patches (None: the control), sharing the reference runs;
    ``_CHUNK`` queries' reference in memory at a time.

    Returns:
        one :class:`BakeEval` per patch, in order.
    """
    figs = _figures_many(model, patches, data, gen_tokens, on_query, tokenizer)
    return [_summarise(f, gen_tokens=gen_tokens) for f in figs]


def evaluate_scoped(
    model: torch.nn.Module,
    patch: Patch,
    data: FitData,
    admitted: list[bool],
    gen_tokens: int = 32,
    tokenizer=None,
) -> tuple[BakeEval, BakeEval, BakeEval]:
    """The patch, the control, and the two served by a scope: the patched model on the queries
    ``admitted`` (one per query of ``data``), the unpatched one on the others.

    Returns:
        ``(patched, control, scoped)``.
    """
    if len(admitted) != len(data.queries):
        raise ValueError(f"{len(admitted)} scope decisions for {len(data.queries)} queries")
    got, ctl = _figures_many(model, [patch, None], data, gen_tokens, None, tokenizer)
    mixed = [p if a else c for p, c, a in zip(got, ctl, admitted, strict=True)]
    patched, control, scoped = (_summarise(f, gen_tokens=gen_tokens) for f in (got, ctl, mixed))
    return patched, control, scoped


def _figures_many(model, patches, data: FitData, gen_tokens: int, on_query, tokenizer):
    """Each patch's per-query figures on ``data`` (:func:`evaluate_many`'s loop)."""
    figs: list[list[_Figures]] = [[] for _ in patches]
    n, done = len(data.queries), 0
    for sub in chunks(data):
        ref = log_probabilities(reference(model, sub, gen_tokens, tokenizer=tokenizer))
        for patch, acc in zip(patches, figs, strict=True):
            acc.extend(_query_figures(model, patch, ref, _BATCH, logprobs=True))
        done += len(sub.queries)
        if on_query is not None:
            on_query(done, n)
    return figs


def chunks(data: FitData) -> list[FitData]:
    """``data`` in parts of ``_CHUNK`` queries (a part's reference logits held at a time)."""
    return [data.part(start, start + _CHUNK) for start in range(0, len(data.queries), _CHUNK)]


def _summarise(found: list[_Figures], gen_tokens: int) -> BakeEval:
    kl_all = torch.cat([f[0] for f in found])
    agree_all = torch.cat([f[1] for f in found])
    matched = [f[2] for f in found]
    answers = [f[3] for f in found if f[3] is not None]
    return BakeEval(
        queries=len(matched),
        positions=int(kl_all.numel()),
        kl=float(kl_all.mean()),
        top1=float(agree_all.double().mean()),
        matched=float(sum(matched) / max(len(matched), 1)),
        gen_tokens=gen_tokens,
        matched_all=matched,
        answers=sum(answers) / len(answers) if answers else None,
    )
