"""What the locator finds: residual MLP blocks, their parts, and the candidates it rejects.

Field values named "fx node" are names of nodes in the traced graph: internal handles for the
solver, never part of a stable report (``ctxc inspect`` prints module paths and op kinds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

__all__ = [
    "AttentionSurface",
    "BlockMap",
    "ExpertOutput",
    "LinearSite",
    "MlpBlock",
    "NodeLabel",
    "NormSite",
    "Rejection",
    "ScaleSite",
    "StepKind",
    "TailStep",
    "Term",
]


@dataclass(frozen=True)
class LinearSite:
    """A linear map applied to an activation, with the parameter that holds its weight.

    Attributes:
        node: fx node of the map's output (after its bias, when the bias is a separate add).
        input: fx node of the tensor the weight multiplies.
        weight: parameter name, as in ``model.state_dict()``.
        bias: parameter name of the bias, or None.
        module: module path of the linear (``model.layers.0.mlp.up_proj``).
        layout: ``"out_in"`` for ``nn.Linear`` ([out, in]); ``"in_out"`` for GPT-2's Conv1D.
        op: the op kind that computes it (``aten.linear``, ``aten.addmm``, ``aten.matmul``,
            ``aten.bmm`` for an expert bank).
        experts: for a stacked expert bank (weight [E, ., .]): fx node of the per-row expert
            ids (rows gathered by expert id), or of the ``split_with_sizes`` whose chunk ``i``
            expert ``i`` multiplies (JetMoE); None for an ordinary linear.
        repeat: bank rows per token (the top-k), when the bank's input repeats each token.
        source: fx node of the rows the input carries (through reshapes and the repeat).
        tokens: fx node of each bank row's token, when the input gathers token rows by index
            (JetMoE sorts rows by expert: ``z[tokens]``); None: ``repeat`` rows per token.
    """

    node: str
    input: str
    weight: str
    bias: str | None
    module: str
    layout: str = "out_in"
    op: str = "aten.linear"
    experts: str | None = None
    repeat: int = 1
    source: str = ""
    tokens: str | None = None


@dataclass(frozen=True)
class ScaleSite:
    """An element-wise trainable scale ``s = alpha * w + offset`` applied to a normalised tensor.

    Attributes:
        node: fx node of the product ``normalized * s`` (of the norm itself when it is fused,
            ``aten.layer_norm``).
        normalized: fx node of the tensor the scale multiplies ("" for a fused norm).
        param: parameter name of ``w``.
        alpha: how ``s`` moves with ``w`` (1.0 for every norm known so far).
        offset: 1.0 for Gemma's ``(1 + w)``, 0.0 for a plain ``w``.
        module: module path of the norm.
    """

    node: str
    normalized: str
    param: str
    alpha: float
    offset: float
    module: str


@dataclass(frozen=True)
class NormSite:
    """A normalisation on the way from the outer linear to the residual add (a post norm).

    Attributes:
        module: module path of the norm.
        input: fx node the norm reads.
        centered: True for a LayerNorm (subtracts the mean), False for an RMS norm.
        fused: the op of a fused norm (``aten.layer_norm``), whose normalised value is not a
            node of the graph; None for a norm written out op by op.
        eps: the norm's epsilon: a fused norm's argument (1e-5 when absent), the constant a
            written norm adds under its root; None where a written norm holds none or several.
        scale: its trainable scale, if any.
        bias: parameter name of the bias added after the scale, if any.
        bias_node: fx node of that addition (of the fused norm).
    """

    module: str
    input: str
    centered: bool
    fused: str | None = None
    eps: float | None = None
    scale: ScaleSite | None = None
    bias: str | None = None
    bias_node: str | None = None


class StepKind(str, Enum):
    """What one op between the outer function's output and the residual add computes.

    A ``str`` enum: a kind compares equal to its value (``step.kind == "add"``).

    The first four are what the solver inverts after the control point (``MlpBlock.tail``); the
    last four occur only while the locator walks the tail, and :meth:`TailStep.after_control`
    turns them into one of the first four once the control point is chosen.

    Members:
        VIEW: identity in value: a cast, copy, dropout or row-keeping reshape.
        ADD: ``x + side``, another term of the sum (a parallel attention output, a shared
            expert, the residual itself at the block's add).
        GAIN: ``x * factor``, a non-zero constant (Granite's residual multiplier; ``x / c``).
        GATE: ``x * side``, ``side`` one number per row (a shared expert's sigmoid gate).
        NORM: the normalised value of a post norm (fused: the norm node itself).
        SCALE: the normalised value times the norm's trainable scale (``side`` the scale).
        BIAS: plus the norm's trainable bias (``side`` the bias parameter).
        COMBINE: an expert bank's weighted rows summed per token.
    """

    VIEW = "view"
    ADD = "add"
    GAIN = "gain"
    GATE = "gate"
    NORM = "norm"
    SCALE = "scale"
    BIAS = "bias"
    COMBINE = "combine"

    def __str__(self) -> str:
        return self.value


class Term(str, Enum):
    """What the other operand of an ``add`` step of a block's tail is (names as reports say)."""

    BIAS = "bias"  # a parameter added as is
    RESIDUAL = "residual"  # the residual stream, at the block's own add
    OTHER = "other term"  # any other activation: an attention output, a shared expert

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class NodeLabel:
    """A graph node as reports name it: stable across exports, unlike fx node names.

    Attributes:
        module: innermost module path of the node ("" for a parameter).
        op: its op kind (``aten.linear``), or ``parameter`` for a parameter placeholder.
    """

    module: str
    op: str


@dataclass(frozen=True)
class TailStep:
    """One op between the output-controlled value and the residual add, in graph order.

    The solver inverts these to turn the block's target ``y_C`` into the value the
    output-controlled part must produce.

    Attributes:
        kind: what the op computes (:class:`StepKind`).
        node: fx node the step computes.
        side: fx node of the other operand (``add``, ``gate``, ``scale``, ``bias``).
        factor: the constant of a ``gain`` step.
        origin: for ``add`` and ``gate`` steps of a block's tail, how reports name ``side``
            (at the residual add: the tensor the residual carries through casts and reshapes).
        term: for ``add`` steps of a block's tail, what ``side`` is.
        mixes_tokens: for an ``other term``, whether it is computed from the residual input
            through a token mixer (the attention output of a parallel block).
    """

    kind: StepKind
    node: str
    side: str | None = None
    factor: float = 1.0
    origin: NodeLabel | None = None
    term: Term | None = None
    mixes_tokens: bool = False

    def after_control(self) -> TailStep:
        """This step as the solver sees it after the control point.

        Returns:
            a bias as one more addend, a norm, scale or combine marker as an identity, and any
            other step unchanged.
        """
        if self.kind == StepKind.BIAS:
            return TailStep(StepKind.ADD, self.node, side=self.side)
        if self.kind in (StepKind.NORM, StepKind.SCALE, StepKind.COMBINE):
            return TailStep(StepKind.VIEW, self.node)
        return self


@dataclass(frozen=True)
class ExpertOutput:
    """How an expert bank's rows are weighted and summed per token (MoE output move).

    Attributes:
        gate: fx node of the per-row routing weights ([rows] or [rows, 1]).
        combine: fx node of the per-token sum over the top-k rows ([tokens, d]).
        top_k: rows per token (0 where the graph does not fix it).
        num_experts: experts in the bank.
        tokens: fx node of each row's token, for a sum by ``index_add`` (JetMoE); None: the
            rows are ``top_k`` consecutive ones per token, summed over a view.
    """

    gate: str
    combine: str
    top_k: int
    num_experts: int
    tokens: str | None = None


@dataclass(frozen=True)
class AttentionSurface:
    """The attention output projection behind a scaled RMS post norm, feeding the block's
    residual ``v`` (Gemma 2/3, OLMo 2): ``v = x + s_a * o / rms(o)``, ``o = W_o a``.

    A second linear surface for the ``lora`` rule (MATH.md 10): a rank-k move of ``W_o`` sets
    each query position's ``o``, so ``v`` reaches any point of ``x + s_a * sphere``.

    Attributes:
        site: the output projection (``o_proj``); ``site.input`` is the attention output ``a``.
        norm: the post-attention norm, with its scale (RMS, no bias).
        add: fx node of ``v``, the add that takes ``x`` back in.
        residual: fx node ``x``, the residual stream entering the attention.
        gain: product of the constant factors between the scale and the add (Beam's depth
            scaling, HyperCLOVA X's multipliers): the branch adds ``gain * s_a * o / r(o)``.
    """

    site: LinearSite
    norm: NormSite
    add: str
    residual: str
    gain: float = 1.0

    @property
    def scale(self) -> ScaleSite:
        """The post-attention norm's trainable scale."""
        assert self.norm.scale is not None
        return self.norm.scale


@dataclass(frozen=True)
class MlpBlock:
    """A residual block ``y = v + g(f(z))``, ``z`` a function of ``v``, with an MLP branch.

    Attributes:
        path: module path of the MLP (``model.layers.0.mlp``).
        residual_in: fx node ``v``, the residual stream entering the block.
        residual_add: fx node ``y``, the block output (the add that takes ``v`` back in).
        branch: fx node of the operand ``y`` adds to the residual side.
        mlp_in: fx node ``z`` that every inner linear reads (input-controllable).
        inner: the inner linears (gate and up; fc_in; the router and expert input banks).
        activation: fx node ``h``, the outer linear's input.
        outer: the outer linear (down projection; fc_out; the experts' output bank).
        gain: product of the constant factors between the outer function and the add.
        output_control: ``linear`` (outer linear), ``scale`` (post-norm scale), ``bias``
            (post-norm bias) or ``experts`` (every active expert's output map, by gate sum).
        control: fx node whose value the output move sets (the outer linear's output, the
            scale product, the bias sum or the experts' per-token sum).
        tail: the steps from ``control`` to ``residual_add``.
        norm: the post norm, if any.
        experts: how the output bank's rows are combined, for ``experts``.
        others: linears inside the branch that are neither inner nor outer (a shared expert's
            down projection): they see matched inputs once the inner moves are done.
        parallel: True when the branch also adds a token mixer's output (attention) that is
            computed from the same residual input (GPT-J, Falcon, Cohere).
        pre_norm: module path of the norm that makes ``z`` from ``v``, or None.
        trailing_norm: module path of a norm applied to ``y`` itself (classic post-LN), or None.
        stable_ok: the outer linear (or an MoE's per-token sum) feeds the post norm directly,
            so the stable rule's linear move applies (MATH.md 4).
        routers: fx nodes of the inner linears whose outputs choose an MoE's experts.
        fused_gate_up: the only inner linear besides routers and banks has its output split in
            two (Phi-3's ``gate_up_proj``): a gated MLP with one fused projection.
        gated_others: for each of ``others``, whether a per-row gate multiplies its output
            before it is summed (Qwen2-MoE's sigmoid-gated shared expert).
        labels: how reports name the block's own nodes, by fx node name (``residual_in``:
            the tensor it carries through casts and reshapes); see :meth:`label`.
        param_shapes: the shape of every parameter of the block's linears and post norm.
        attention: the attention output projection behind a post norm that makes ``v``, when
            the block is a dense sandwich-norm block (:class:`AttentionSurface`), else None.
    """

    path: str
    residual_in: str
    residual_add: str
    branch: str
    mlp_in: str
    inner: tuple[LinearSite, ...]
    activation: str
    outer: LinearSite
    gain: float = 1.0
    output_control: str = "linear"
    control: str = ""
    tail: tuple[TailStep, ...] = ()
    norm: NormSite | None = None
    experts: ExpertOutput | None = None
    others: tuple[LinearSite, ...] = ()
    parallel: bool = False
    pre_norm: str | None = None
    trailing_norm: str | None = None
    stable_ok: bool = False
    routers: tuple[str, ...] = ()
    fused_gate_up: bool = False
    gated_others: tuple[bool, ...] = ()
    labels: tuple[tuple[str, NodeLabel], ...] = ()
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    attention: AttentionSurface | None = None

    @property
    def scale(self) -> ScaleSite | None:
        """The post norm's trainable scale, if it has one."""
        return self.norm.scale if self.norm is not None else None

    def label(self, node: str) -> NodeLabel:
        """How reports name the block's node ``node`` (one of its parts' fx nodes).

        Args:
            node: fx node name: ``residual_in``, ``mlp_in``, ``activation``,
                ``residual_add``, or an expert gate or combine node.

        Returns:
            its :class:`NodeLabel`.
        """
        return dict(self.labels)[node]

    def param_shape(self, param: str) -> tuple[int, ...]:
        """The shape of one of the block's parameters (``()`` for a name it does not hold)."""
        return dict(self.param_shapes).get(param, ())


@dataclass(frozen=True)
class Rejection:
    """A candidate that admits no exact patch, and why (with the offending value).

    Attributes:
        where: module path of the candidate: an MLP whose tail cannot be inverted, or (when a
            model has no block at all) a linear that is not the outer linear of an MLP.
        reason: what fails, naming the op or the value.
    """

    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class BlockMap:
    """Every residual MLP block of a traced model, in graph order, and every rejected candidate.

    Attributes:
        blocks: the patchable blocks.
        rejections: candidates that are not patchable, with reasons.
        head: fx node of the LM head linear, when only position-wise ops follow it (the full
            run then computes logits at the query positions only), else None.
        head_module: module path of that linear, or None.
        notes: MLP-shaped cores that are no residual MLP branch (an attention projection, an
            output head's transform), with why: shown by inspect, never a failure.
    """

    blocks: tuple[MlpBlock, ...]
    rejections: tuple[Rejection, ...] = ()
    head: str | None = None
    head_module: str | None = None
    notes: tuple[Rejection, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    @cached_property
    def node_names(self) -> frozenset[str]:
        """Every fx node name the blocks' records hold: the nodes a solver may stop at, read or
        act on (module paths and parameter names come along; they name no node).

        Cached on the map (``ctxc generate`` solves every token on the same blocks: walking
        them took 6 ms of a 220 ms step on Gemma 3 270M).
        """
        found: set[str] = set()
        stack: list = list(self.blocks)
        while stack:
            v = stack.pop()
            if type(v) is str:  # not the str enums (a step kind "add" names no node of its own)
                found.add(v)
            elif isinstance(v, tuple | list):
                stack.extend(v)
            elif isinstance(v, dict):
                stack.extend(v)  # the keys of ``labels`` are node names
            elif dataclasses.is_dataclass(v):
                stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
        return frozenset(found)
