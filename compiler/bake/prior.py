"""The ridge's prior of a bake: where the inputs of text unrelated to the context lie (issue 53).

A fitted move ``dW`` changes every input ``k`` of its linear by ``dW k``, on the context's
queries and off them. The fit's rows see the context's queries only (and a few off-topic rows),
so its ridge, ``lam ||dW||^2``, charges every direction of the input alike. With ``M``, the
second moment ``E[k k^T]`` of the linear's inputs on the model's own text from its prefix alone
(no context), the ridge ``lam tr(dW M dW^T) = lam E_k ||dW k||^2`` charges a move by what it
changes on such text: the covariance term of MEMIT (Meng et al. 2023, "Mass-Editing Memory in a
Transformer", eq. 14), here over the model's own samples instead of Wikipedia, so no data ship.

``BakeOptions.prior`` is the share of that second moment in the metric:
``M = (1 - share) I + share C / (tr C / in)`` (trace ``in``, so ``ridge`` keeps its scale; the
identity share keeps ``M`` positive definite where the samples span fewer directions than
``in``). The post-norm scale moves keep their own ridge.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ctxc.passes.locate.block_map import BlockMap

__all__ = ["PRIOR_SAMPLES", "PRIOR_TOKENS", "input_priors", "moved_linears"]

PRIOR_SAMPLES = 32  # continuations sampled from the prefix alone
PRIOR_TOKENS = 64  # tokens each: 2,048 inputs per linear
_PRIOR_SEED = 7  # added to the bake's seed: other draws than the off-topic rows' (5) and the fit's


def moved_linears(blocks: BlockMap, attention: bool) -> list[str]:
    """The weight names of the linears a fit may move: every block's inner and outer linears,
    and its attention output projection with ``attention`` (where the block has one)."""
    names: list[str] = []
    for block in blocks.blocks:
        names += [site.weight for site in block.inner if not site.experts]
        if block.outer is not None:
            names.append(block.outer.weight)
        if attention and block.attention is not None:
            names.append(block.attention.site.weight)
    return list(dict.fromkeys(names))


def input_priors(
    model: torch.nn.Module,
    prefix: Sequence[int],
    names: Sequence[str],
    share: float,
    seed: int,
    samples: int = PRIOR_SAMPLES,
    tokens: int = PRIOR_TOKENS,
) -> dict[str, torch.Tensor]:
    """Each named linear's ridge metric from the model's own text (module docstring).

    Args:
        model: the unpatched causal LM (left as it was).
        prefix: what the patched model is fed first (BOS, a chat template's opening): the
            samples continue it, and its positions are left out (BOS's input is the same in
            every row and very large: the fit leaves it out too).
        names: weight names (``model.layers.3.mlp.down_proj.weight``), each an ``nn.Linear``'s
            (or a Conv1D's) weight.
        share: the second moment's share of the metric, in (0, 1].
        seed: the bake's seed (the samples draw from their own offset of it).
        samples: continuations sampled from ``prefix``.
        tokens: tokens per continuation.

    Returns:
        weight name -> ``M`` [in, in] float32, symmetric positive semi-definite (definite
        below share 1), trace ``in``: one such matrix per input read (the gate and up
        projections share theirs; Gemma 3 270M: about 0.4 GB), which is why this stays
        library-only (measured worse: docs/bake.md).

    Raises:
        ValueError: an empty prefix, or a name that is not a module's ``weight``.
    """
    from ctxc.bake.data import sample_continuations

    if not prefix:
        raise ValueError("the prior samples from the prefix: this bake has none")
    modules = {}
    for name in names:
        path, _, leaf = name.rpartition(".")
        if leaf != "weight":
            raise ValueError(f"{name} is not a module's weight")
        modules[name] = model.get_submodule(path)
    rows = sample_continuations(model, list(prefix), samples, tokens, seed + _PRIOR_SEED)
    p = len(prefix)
    sums: dict[str, torch.Tensor] = {}
    last: list = [None, None]  # the last input seen and its Gram: gate and up read one tensor

    def hook(name: str):
        def record(_module, args) -> None:
            x = args[0]
            if last[0] is not x:  # held, so no other tensor can take its identity meanwhile
                k = x[:, p:].reshape(-1, x.shape[-1]).float()  # [b * tokens, in]
                last[:] = [x, (k.T @ k).double()]  # [in, in]
            sums[name] = last[1]

        return record

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            ids = torch.tensor([list(prefix) + r for r in rows], device=device)  # [K, p + T]
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
        last.clear()
    count = len(rows) * tokens
    metrics: dict[int, torch.Tensor] = {}  # one metric per input, shared by the linears reading it
    for gram in sums.values():
        if id(gram) in metrics:
            continue
        c = gram / count  # [in, in]: E[k k^T]
        d = c.shape[0]
        trace = float(torch.diagonal(c).sum())
        eye = torch.eye(d, dtype=torch.float64)
        m = eye if trace <= 0 else (1 - share) * eye + share * c * (d / trace)
        metrics[id(gram)] = m.float()
    return {name: metrics[id(sums[name])] for name in names}
