"""Renderer: an inspection as readable text, one line per part."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model's methods call this module: no import cycle at run time
    from ctxc.inspect.analysis import BlockInspection, ModelInspection, PatchEntry, TailEntry

__all__ = ["patch_kind_text", "render_text", "tail_text"]


def render_text(info: ModelInspection) -> str:
    """The text report.

    Args:
        info: the inspection.

    Returns:
        a summary line, one line per shape (lettered in name order), per block its parts,
        tail and patches per rule, one line per rejection, and the rank note (no final newline).
    """
    s = info.summary()
    lines = [
        f"{info.model_class} ({info.model or 'model'}): {s.patchable} patchable "
        f"block(s), {s.rejected} rejected; patched parameters: "
        + ", ".join(f"{r} {n}" for r, n in s.patched_params)
    ]
    letters = {shape: chr(ord("A") + i) for i, (shape, _) in enumerate(s.shapes)}
    lines += [f"  shape {letters[shape]}: {shape} ({n} block(s))" for shape, n in s.shapes]
    for b in info.blocks:
        lines += _block_lines(b, letters[b.shape])
    lines += [f"{r.path}: REJECTED: {r.reason}" for r in info.rejections]
    lines += [f"{r.path}: note: {r.reason}" for r in info.notes]
    lines.append(f"({s.rank_note})")
    return "\n".join(lines)


def _block_lines(b: BlockInspection, letter: str) -> list[str]:
    lines = [f"{b.path} [shape {letter}]"]
    for p in b.parts:
        param = f" {p.param}" if p.param else ""
        lines.append(f"    {p.part:<22} {p.module or '-'} ({p.op}){param}: {p.control}")
    tail = " -> ".join(tail_text(t) for t in b.tail) or "-"
    lines.append(f"    tail to the residual add: {tail}")
    for rule, patches in b.patches:
        desc = ", ".join(f"{p.param} ({p.move}, {patch_kind_text(p)})" for p in patches)
        lines.append(f"    {rule:<8} patches {desc}")
    return lines


def patch_kind_text(p: PatchEntry) -> str:
    """``vector``, ``rank r``, or ``rank 1 per routed expert``.

    Args:
        p: a patch entry.

    Returns:
        its kind in words.
    """
    if p.kind == "vector":
        return "vector"
    if p.kind == "expert matrices":
        return "rank 1 per routed expert"
    return f"rank {p.rank}"


def tail_text(t: TailEntry) -> str:
    """One tail op in words: ``x 0.37``, ``x gate (m)``, ``+ residual (m)``.

    Args:
        t: a tail entry.

    Returns:
        the op and what it adds or multiplies by.
    """
    if t.op == "times":
        return f"x {t.factor:g}"
    if t.op == "times gate":
        return f"x gate ({t.module})"
    if t.term == "other term" and t.mixes_tokens:
        return f"+ {t.module} (token mixer: parallel)"
    return f"+ {t.term} ({t.module or 'parameter'})"
