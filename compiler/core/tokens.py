"""How a context and a query become token ids (DESIGN.md, CLI contract)."""

from __future__ import annotations

from ctxc.core.errors import CtxcError

__all__ = ["split_tokens"]


def split_tokens(tokenizer, context: str, query: str | None) -> tuple[list[int], list[int]]:
    """The context ids and the query ids.

    The full input is ``tokenizer(context)`` (with the model's usual special tokens) followed by
    ``tokenizer(query, add_special_tokens=False)``. Without a query, the query is the context's
    last token.

    Returns:
        ``(context_ids, query_ids)``; both non-empty.

    Raises:
        CtxcError: empty context, empty query, or a context too short to split.
    """
    if not context.strip():
        raise CtxcError("the context is empty")
    context_ids = list(tokenizer(context).input_ids)
    if query is None:
        if len(context_ids) < 2:
            raise CtxcError("the context has a single token: nothing is left to compile")
        return context_ids[:-1], context_ids[-1:]
    if not query:
        raise CtxcError("the query is empty")
    query_ids = list(tokenizer(query, add_special_tokens=False).input_ids)
    if not query_ids:
        raise CtxcError("the query tokenizes to no tokens")
    return context_ids, query_ids
