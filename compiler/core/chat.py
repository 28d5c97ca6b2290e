"""A chat conversation split into context ids and query ids by the tokenizer's own chat template.

The context is the conversation before its last user turn (a system prompt, a document in a
user turn, earlier turns); the query is that last user turn with the template's generation
prompt (``apply_chat_template(..., add_generation_prompt=True)``). The split is taken where the
template really puts a boundary: the context rendered alone must be a prefix of the whole
conversation's rendering, as text and as token ids, and every context message must appear in it;
a template that cannot be split so is refused, with the reason (docs/chat.md). Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ctxc.core.errors import CtxcError

__all__ = [
    "NO_TEMPLATE",
    "ChatSplit",
    "chat_messages",
    "check_messages",
    "images_in",
    "read_messages",
    "split_chat",
    "template_ids",
]

_ROLES = ("system", "user", "assistant")

NO_TEMPLATE = (
    "the model's tokenizer has no chat template (tokenizer.chat_template): a chat context needs "
    "one; give the context and the query as plain text instead"
)


@dataclass(frozen=True)
class ChatSplit:
    """A conversation split at a turn boundary of its template.

    Attributes:
        context_ids: the template's ids for the context turns (no generation prompt).
        query_ids: the rest of the template's ids for the whole conversation with its
            generation prompt: what the patched model must be fed.
        context_text: the context turns as the template renders them.
        query_text: the rendered query turn (``query_ids`` as text, the template's special
            tokens written out): the whole rendering less ``context_text``.
        query_text_alone: tokenizing ``query_text`` alone (no special tokens added) gives
            ``query_ids`` exactly; when False, feed the ids, not the text.
        messages: the whole conversation, the query turn last.
        split: ``turn`` (the context rendered alone ends where the query's turn starts) or
            ``in the query's turn`` (the context ends inside it: see :func:`split_chat`).
        why: why the split is not at the turn (empty when it is).
        merged: the template refuses two user turns in a row: the context's last user turn
            (a document) and the query were given as one user turn.
    """

    context_ids: list[int]
    query_ids: list[int]
    context_text: str
    query_text: str
    query_text_alone: bool
    messages: tuple[dict, ...]
    split: str = "turn"
    why: str = ""
    merged: bool = False

    def to_dict(self) -> dict:
        """The report's ``chat`` entry (the ids are the report's ``query_ids``)."""
        return {
            "query_text": self.query_text,
            "query_text_tokenizes_to_query_ids": self.query_text_alone,
            "context_turns": len(self.messages) - 1,
            "roles": [m["role"] for m in self.messages],
            "messages": [dict(m) for m in self.messages],
            "split": self.split,
            "split_why": self.why or None,
            "document_and_query_in_one_turn": self.merged,
        }


def check_messages(messages: object, where: str = "messages") -> list[dict]:
    """``messages`` checked: a non-empty list of ``{"role", "content"}`` objects, each role
    ``system``, ``user`` or ``assistant``, each content a non-empty string or a non-empty list
    of parts ``{"type": "text", "text": str}`` and ``{"type": "image"}`` (an image context:
    the images themselves are given apart, in order).

    Args:
        where: what to call the list in an error (a file's name).

    Returns:
        the messages as plain ``{"role", "content"}`` dicts.

    Raises:
        CtxcError: naming the first bad item.
    """
    if not isinstance(messages, list) or not messages:
        raise CtxcError(
            f"{where} must be a non-empty JSON list of {{role, content}} objects "
            f"(got {type(messages).__name__ if messages != [] else 'an empty list'})"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m:
            raise CtxcError(f"{where}[{i}] must be an object with 'role' and 'content' only")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise CtxcError(f"{where}[{i}]: role must be one of {', '.join(_ROLES)} (got {role!r})")
        if isinstance(content, list):
            content = [_part(p, f"{where}[{i}]") for p in content]
        elif not isinstance(content, str):
            raise CtxcError(
                f"{where}[{i}]: content must be a string or a list of parts "
                f"(got {type(content).__name__})"
            )
        if not content or (isinstance(content, str) and not content.strip()):
            raise CtxcError(f"{where}[{i}]: the {role} message is empty")
        out.append({"role": role, "content": content})
    return out


def _part(part: object, where: str) -> dict:
    """One part of a list content, checked: ``{"type": "text", "text"}`` or ``{"type":
    "image"}``."""
    if isinstance(part, dict) and part.get("type") == "image" and set(part) == {"type"}:
        return {"type": "image"}
    if (
        isinstance(part, dict)
        and part.get("type") == "text"
        and set(part) == {"type", "text"}
        and isinstance(part["text"], str)
    ):
        return {"type": "text", "text": part["text"]}
    raise CtxcError(
        f'{where}: a part must be {{"type": "text", "text": ...}} or '
        f'{{"type": "image"}} (the images given apart, in order); got {part!r:.60}'
    )


def images_in(messages: Sequence[dict]) -> int:
    """How many ``{"type": "image"}`` parts ``messages`` hold."""
    return sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    )


def read_messages(path: Path) -> list[dict]:
    """The conversation in the JSON file ``path`` (:func:`check_messages`).

    Raises:
        CtxcError: unreadable, not JSON, or not a list of role/content objects.
    """
    from ctxc.core.textfile import read_text

    text = read_text(path, "messages file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CtxcError(f"messages file {path} is not JSON: {exc.msg} (line {exc.lineno})") from exc
    return check_messages(data, f"messages file {path}")


def chat_messages(
    system: str | None = None,
    document: str | None = None,
    messages: Sequence[dict] | None = None,
    query: str | None = None,
) -> tuple[list[dict], str]:
    """The context turns and the query of a conversation given in parts.

    Args:
        system: a system prompt (the first turn).
        document: a document, as a user turn after the system prompt.
        messages: a whole conversation instead (then neither ``system`` nor ``document``).
        query: the next user message; None: the last message of ``messages`` (a user turn).

    Returns:
        ``(context messages, query text)``.

    Raises:
        CtxcError: nothing given, an empty part, or a last message that is not a user turn.
    """
    if messages is not None and (system is not None or document is not None):
        raise CtxcError("give messages, or a system prompt and/or a document, not both")
    if messages is not None:
        turns = check_messages(list(messages) if isinstance(messages, tuple) else messages)
    else:
        turns = []
        for role, text, name in (
            ("system", system, "system prompt"),
            ("user", document, "document"),
        ):
            if text is None:
                continue
            if not isinstance(text, str) or not text.strip():
                raise CtxcError(f"the {name} is empty")
            turns.append({"role": role, "content": text})
        if not turns:
            raise CtxcError("a chat context needs a system prompt, a document or messages")
    if query is None:
        if messages is None:
            raise CtxcError().naming("a chat context needs a {query} (the next user message)")
        last = turns[-1]
        if last["role"] != "user":
            raise CtxcError(
                f"without a query the last message is the query: it must be a user turn "
                f"(got {last['role']})"
            )
        turns, query = turns[:-1], last["content"]
        if not turns:
            raise CtxcError("the conversation has no turn before the query: nothing to compile")
    elif not isinstance(query, str) or not query.strip():
        raise CtxcError("the query is empty")
    return turns, query


def split_chat(
    tokenizer, context: Sequence[dict], query: str, images: Sequence | None = None
) -> ChatSplit:
    """Split the conversation ``context + [user: query]`` by ``tokenizer``'s chat template.

    The split is the query's turn when the context rendered alone is a prefix of the whole
    rendering; else, where the template folds context into the query's turn (Gemma 3's system
    prompt) or renders earlier turns differently once a user turn follows (Qwen 3 strips
    thinking), the part of the whole rendering no query changes (found by rendering two probe
    queries), which then ends inside the query's turn. A template that refuses two user turns in
    a row gets a trailing user turn of the context (a document) and the query in one user turn,
    the document first, a blank line between. Either way every context message must be in the
    context's text and its ids a prefix of the whole conversation's.

    Args:
        tokenizer: a Transformers tokenizer with a ``chat_template``.
        context: the context turns (:func:`chat_messages`).
        query: the next user message.
        images: the images of the context's ``{"type": "image"}`` parts, in order (PIL
            images); then ``tokenizer`` is the model's processor, whose ids expand each image.

    Returns:
        the :class:`ChatSplit`.

    Raises:
        CtxcError: no chat template, the template refuses the conversation, or no boundary
            separates context and query (the message says why).
    """
    if getattr(tokenizer, "chat_template", None) in (None, ""):
        raise CtxcError(NO_TEMPLATE)
    context = list(context)
    if len(images or ()) != images_in(context):
        raise CtxcError(
            f"{len(images or ())} image(s) for {images_in(context)} image part(s) in the "
            "context's messages"
        )
    images = images or None
    merged = False
    try:
        whole_text = _render(tokenizer, _with_query(context, query, False), True)
    except CtxcError:
        if not context or context[-1]["role"] != "user":
            raise
        merged = True  # e.g. Gemma 3: roles must alternate
        whole_text = _render(tokenizer, _with_query(context, query, True), True)
    whole = _with_query(context, query, merged)
    fixed = _query_independent(tokenizer, context, query, merged, whole_text)
    context_text, split, why = None, "turn", ""
    if not merged:
        context_text, why = _turn_prefix(tokenizer, context, whole_text, fixed)
    if context_text is None:
        context_text, split = whole_text[:fixed], "in the query's turn"
        missing = _missing(context, context_text)
        if missing is not None:
            raise CtxcError(
                f"the chat template cannot be split: {why or 'the context turns'}, and its "
                f"{missing} message is not in the part of the conversation that comes before "
                "every query"
            )
    context_ids, query_ids = _token_split(tokenizer, (context_text, whole_text), whole, images)
    query_text = whole_text[len(context_text) :]
    return ChatSplit(
        context_ids=context_ids,
        query_ids=query_ids,
        context_text=context_text,
        query_text=query_text,
        query_text_alone=_ids(getattr(tokenizer, "tokenizer", tokenizer), query_text) == query_ids,
        messages=tuple(whole),
        split=split,
        why=why,
        merged=merged,
    )


def _token_split(tokenizer, texts: tuple[str, str], whole: list[dict], images) -> tuple:
    """(context ids, query ids): the whole conversation's ids cut where the context's end,
    which must be a prefix of them (no token merges across the boundary).

    Args:
        texts: the context's text and the whole conversation's.
        whole: the whole conversation (its template ids are checked against the text's).
        images: the context's images, or None.
    """
    context_text, whole_text = texts
    context_ids = _ids(tokenizer, context_text, images)
    whole_ids = _ids(tokenizer, whole_text, images)
    if images is None and whole_ids != template_ids(tokenizer, whole):  # the template's own
        raise CtxcError("the chat template's ids differ from its rendered text's tokens")
    k = len(context_ids)
    if whole_ids[:k] != context_ids:
        n = next(i for i, (a, b) in enumerate(zip(context_ids, whole_ids, strict=False)) if a != b)
        raise CtxcError(
            f"the chat template cannot be split: the context's last tokens merge with the "
            f"query's first (token {n} of the context alone differs in the whole conversation)"
        )
    if k == len(whole_ids):
        raise CtxcError("the chat template renders the query to no tokens")
    return context_ids, whole_ids[k:]


def _with_query(context: list[dict], query: str, merged: bool) -> list[dict]:
    """The whole conversation: ``query`` as the next user turn, or (``merged``) appended to the
    context's last user turn after a blank line."""
    if not merged:
        return [*context, {"role": "user", "content": query}]
    last = context[-1]["content"]
    content: str | list
    if isinstance(last, list):  # parts: the query's text after them
        content = [*last, {"type": "text", "text": f"\n\n{query}"}]
    else:
        content = f"{last}\n\n{query}"
    return [*context[:-1], {"role": "user", "content": content}]


def _query_independent(tokenizer, context: list[dict], query: str, merged: bool, whole: str) -> int:
    """How many leading characters of the whole rendering no query changes: the common prefix
    of the renderings with two probe queries and with ``query``."""
    a, b = (_render(tokenizer, _with_query(context, p, merged), True) for p in ("A", "B"))
    return min(_common(a, b), _common(a, whole), _common(b, whole))


def _turn_prefix(tokenizer, context: list[dict], whole: str, fixed: int) -> tuple:
    """(the context rendered alone, "") when it is a query-independent prefix of ``whole`` that
    holds every context message; else (None, why not)."""
    try:
        text = _render(tokenizer, context, False)
    except CtxcError as exc:
        return None, f"the context alone is refused ({exc})"
    if not whole.startswith(text) or len(text) > fixed:
        n = _common(text, whole)
        return None, (
            "it renders the context's turns differently once the query's turn follows "
            f"(character {n}: {text[n : n + 24]!r} alone, {whole[n : n + 24]!r} before the "
            "query; e.g. it strips thinking from earlier turns)"
        )
    missing = _missing(context, text)
    if missing is not None:
        return None, (
            f"it renders the context alone without its {missing} message (it goes inside the "
            "next user turn, as Gemma 3 puts a system prompt in the first user turn)"
        )
    return text, ""


def _missing(context: list[dict], text: str) -> str | None:
    """The role of the first context message whose content (each text part) is not in ``text``
    (None: all are)."""
    for m in context:
        content = m["content"]
        parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content]
        if any(p.strip() not in text for p in parts):
            return m["role"]
    return None


def _common(a: str, b: str) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _render(tokenizer, messages: list[dict], generation: bool) -> str:
    """The template's text for ``messages``; a template error is the user's one line."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
    except Exception as exc:  # jinja's TemplateError (raise_exception), a missing variable
        if isinstance(exc, CtxcError):
            raise
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CtxcError(f"the chat template refuses this conversation: {first}") from exc
    if not isinstance(text, str):  # a batch: one conversation was given
        text = text[0]
    return text


def _ids(tokenizer, text: str, images: Sequence | None = None) -> list[int]:
    """``text``'s ids as ``apply_chat_template`` tokenizes a rendering: no special tokens added
    (the template writes its own BOS); with ``images``, the processor's, each image's
    placeholder expanded into its image tokens."""
    if images is None:
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    try:
        ids = tokenizer(text=text, images=list(images), add_special_tokens=False)["input_ids"]
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CtxcError(f"the processor rejected the chat's images: {first}") from None
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The template's ids for the conversation ``messages``, with the generation prompt."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(out, list):  # Transformers 5: a BatchEncoding
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]
