"""The inspection model: what ``ctxc inspect`` reports about a model, as frozen dataclasses.

Built by :func:`ctxc.inspect.inspection.describe` from the block map (never from the graph), and
written by one renderer per format: :mod:`ctxc.inspect.render_text`,
:mod:`ctxc.inspect.render_json` and
:mod:`ctxc.inspect.render_html`. Everything here names modules, parameters and op kinds, never fx
node
names, so the JSON is stable across exports.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = [
    "RANK_NOTE",
    "BlockInspection",
    "ModelInspection",
    "Norms",
    "Part",
    "PatchEntry",
    "RejectedBlock",
    "Summary",
    "TailEntry",
]

RANK_NOTE = (
    "ranks are for a single-token query; a k-token query gives rank-k matrix moves (a post-norm "
    "scale is shared by the k positions, with a rank-k move of the outer linear under every "
    "rule; a post-norm bias matches one position only)"
)


@dataclass(frozen=True)
class Part:
    """One part of a block and its controllability role.

    Attributes:
        part: the role name (``inner_linear``, ``post_norm_scale``, ... as in ``classify``).
        module: module path ("" for a bare parameter).
        op: op kind (``aten.linear``), or a description (``bias``, ``times (1 w + 0)``).
        control: ``input-controllable``, ``output-controllable`` or ``neither``.
        param: the parameter a patch can change here, if any.
        layout: for a linear, ``out_in`` or ``in_out`` (GPT-2's Conv1D).
        weight_shape: for a linear, its weight's shape.
        bias: for a linear, its bias parameter, if any.
        experts: for an expert bank, the number of experts.
        patched_by_default: whether the default rule patches ``param`` (None: not said).
        norm: for ``mlp_in``, the module of the norm that makes it (None: no pre norm).
        note: for ``trailing_norm``, why it needs no patch of its own.
    """

    part: str
    module: str
    op: str
    control: str
    param: str | None = None
    layout: str | None = None
    weight_shape: tuple[int, ...] | None = None
    bias: str | None = None
    experts: int | None = None
    patched_by_default: bool | None = None
    norm: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class TailEntry:
    """One op between the output-controlled part and the residual add (identities left out).

    Attributes:
        op: ``times`` (a constant), ``times gate`` (a per-row gate) or ``plus``.
        factor: the constant of ``times``.
        module: module path of the gate or of the added term.
        node_op: op kind of the gate or of the added term.
        term: for ``plus``: ``bias``, ``residual`` or ``other term``.
        mixes_tokens: for an ``other term``: computed through a token mixer (parallel block).
    """

    op: str
    factor: float | None = None
    module: str | None = None
    node_op: str | None = None
    term: str | None = None
    mixes_tokens: bool | None = None


@dataclass(frozen=True)
class PatchEntry:
    """One parameter an update rule patches in a block.

    Attributes:
        param: parameter name.
        module: its module path.
        move: ``input`` or ``output``.
        kind: ``matrix``, ``expert matrices`` or ``vector``.
        shape: the parameter's shape.
        floats: numbers stored per single-token patch (matrix: ``u`` and ``v``).
        rank: the rank of a matrix move (None for a vector).
        experts: for expert matrices, the experts in the bank.
        active_per_token: for expert matrices, the experts a token routes to.
    """

    param: str
    module: str
    move: str
    kind: str
    shape: tuple[int, ...]
    floats: int
    rank: int | None = 1
    experts: int | None = None
    active_per_token: int | None = None


@dataclass(frozen=True)
class Norms:
    """Module paths of a block's norms: before the MLP, after it, on the residual sum."""

    pre: str | None
    post: str | None
    trailing: str | None


@dataclass(frozen=True)
class BlockInspection:
    """One residual MLP block.

    Attributes:
        path: module path of the MLP.
        shape: its shape in words (arrangement, norms, MLP kind, linears, gain).
        arrangement: ``sequential`` or ``parallel``.
        norms: its norms.
        mlp: the MLP kind in words (``gated MLP``, ``mixture of experts (...)``).
        gain: product of the constant factors on the branch.
        output_control: ``linear``, ``scale``, ``bias`` or ``experts``.
        parts: its parts, from the residual input to the add.
        tail: the ops between the output-controlled part and the residual add.
        patches: per update rule, in the solver's order, the parameters it patches.
    """

    path: str
    shape: str
    arrangement: str
    norms: Norms
    mlp: str
    gain: float
    output_control: str
    parts: tuple[Part, ...]
    tail: tuple[TailEntry, ...]
    patches: tuple[tuple[str, tuple[PatchEntry, ...]], ...]


@dataclass(frozen=True)
class RejectedBlock:
    """A candidate block that admits no exact patch, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class Summary:
    """Counts over a model's blocks (``shapes`` and ``output_controls`` sorted by name)."""

    blocks: int
    patchable: int
    rejected: int
    shapes: tuple[tuple[str, int], ...]
    output_controls: tuple[tuple[str, int], ...]
    patched_params: tuple[tuple[str, int], ...]
    patch_floats: tuple[tuple[str, int], ...]
    rank_note: str = RANK_NOTE


@dataclass(frozen=True)
class ModelInspection:
    """What the analyses find in a model: every block, every rejected candidate.

    Attributes:
        model: the name the model was loaded by ("" when unknown).
        model_class: its Python class name.
        head: module path of the LM head, when only position-wise ops follow it.
        blocks: the patchable blocks, in graph order.
        rejections: the candidates that are not patchable.
        rules: the update rules, in the solver's order.
        notes: MLP-shaped cores that are no residual block (attention projections, output
            heads), with why; never a failure.
    """

    model: str
    model_class: str
    head: str | None
    blocks: tuple[BlockInspection, ...]
    rejections: tuple[RejectedBlock, ...]
    rules: tuple[str, ...]
    notes: tuple[RejectedBlock, ...] = ()

    def summary(self) -> Summary:
        """Counts over the blocks."""
        shapes = Counter(b.shape for b in self.blocks)
        controls = Counter(b.output_control for b in self.blocks)
        patches = [dict(b.patches) for b in self.blocks]
        return Summary(
            blocks=len(self.blocks) + len(self.rejections),
            patchable=len(self.blocks),
            rejected=len(self.rejections),
            shapes=tuple(sorted(shapes.items())),
            output_controls=tuple(sorted(controls.items())),
            patched_params=tuple((r, sum(len(p[r]) for p in patches)) for r in self.rules),
            patch_floats=tuple(
                (r, sum(e.floats for p in patches for e in p[r])) for r in self.rules
            ),
        )
