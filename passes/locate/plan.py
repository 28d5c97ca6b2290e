"""Analysis: what an update rule moves in a block, the one answer the solver and reports read.

``plan(block, rule)`` says which parameters the rule changes and how: the input move on the
inner linears (MATH.md 1; the router and every routed expert's input bank of an MoE), then the
output move on the output-controlled part (the outer linear, the active experts' output maps, a
post norm's bias, or its scale, which the stable rule reaches through the outer linear first,
MATH.md 4). The solver follows it, ``classify`` and ``ctxc inspect`` describe it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxc.core.errors import SolveError
from ctxc.core.vocabulary import LORA_RULE, OUTPUT_RULE, RULES, STABLE_RULE
from ctxc.passes.locate.block_map import LinearSite, MlpBlock
from ctxc.passes.locate.graph_view import GraphView

__all__ = [
    "LORA_RULE",
    "RULES",
    "BlockPlan",
    "ParamMove",
    "check_in_time",
    "checked_plan",
    "multi_refusal",
    "plan",
]


@dataclass(frozen=True)
class ParamMove:
    """One parameter a rule changes, and how.

    Attributes:
        param: parameter name, as in ``model.state_dict()``.
        module: module path that holds it.
        move: ``input`` (moves the inner activation) or ``output`` (adds to the branch output).
        kind: ``matrix``, ``expert matrices`` (a stacked bank [E, ., .], one delta per routed
            expert) or ``vector`` (a dense change of a norm's scale or bias).
        part: ``inner_linear``, ``router``, ``expert_input_bank``, ``outer_linear``,
            ``expert_output_bank``, ``post_norm_scale``, ``post_norm_bias`` or
            ``attention_output`` (the projection behind the post-attention norm, ``lora``) (as in
            :class:`~ctxc.passes.locate.classify.Role`).
        rank: rank added per query token (a k-token query gives rank k; per routed expert for
            a bank: the tokens routed to it); 0 for a vector.
        site: the linear (matrices), else None.
    """

    param: str
    module: str
    move: str
    kind: str
    part: str
    rank: int
    site: LinearSite | None = None


@dataclass(frozen=True)
class BlockPlan:
    """What a rule changes in one block, in the order the solver changes it.

    Attributes:
        path: module path of the block.
        rule: the update rule.
        output_control: ``linear``, ``scale``, ``bias`` or ``experts`` (the block's).
        moves: every parameter change, in graph order: the attention output projection
            (``lora`` on a sandwich-norm block), input moves (the inner linears), then output
            moves (the outer linear before the scale it feeds).
        stable: the outer linear moves the MLP output to the unit-RMS target before the scale
            takes the remainder (MATH.md 4); False when the scale alone moves.
    """

    path: str
    rule: str
    output_control: str
    moves: tuple[ParamMove, ...]
    stable: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        """The parameter names changed, in order."""
        return tuple(m.param for m in self.moves)

    @property
    def input_moves(self) -> tuple[ParamMove, ...]:
        return tuple(m for m in self.moves if m.move == "input")

    @property
    def output_moves(self) -> tuple[ParamMove, ...]:
        return tuple(m for m in self.moves if m.move == "output")

    @property
    def attention(self) -> bool:
        """The attention output projection moves too (``lora`` on a sandwich-norm block)."""
        return any(m.part == "attention_output" for m in self.moves)

    @property
    def moves_inputs(self) -> bool:
        """The rule moves the inner input (every rule but ``output``)."""
        return self.rule != OUTPUT_RULE

    @property
    def post_norm_scale(self) -> bool:
        """A post norm's element-wise scale takes the output move (one query position only)."""
        return self.output_control == "scale"


def plan(block: MlpBlock, rule: str, k: int = 1) -> BlockPlan:
    """What ``rule`` changes in ``block`` for a ``k``-token query (pure).

    Args:
        block: a located block.
        rule: one of :data:`RULES`, validated where it entered the library
            (``ctxc.core.options.CompileOptions``).
        k: query tokens; with k > 1 every rule moves the outer linear before a post-norm scale
            (one scale for k positions, MATH.md 9: ``multi_scale.py``).

    Returns:
        the :class:`BlockPlan`.
    """
    moves: list[ParamMove] = []
    if rule != OUTPUT_RULE:
        moves += [_matrix(site, "input", _inner_part(block, site)) for site in block.inner]
    ctl = block.output_control
    outer_part = "expert_output_bank" if block.outer.experts else "outer_linear"
    if rule == LORA_RULE:  # no vector: the outer linear only, and only where it feeds y
        if block.attention is not None:  # and the attention's, behind its own norm (MATH.md 10)
            moves.insert(0, _matrix(block.attention.site, "output", "attention_output"))
        if ctl in ("linear", "experts") or (ctl == "scale" and block.stable_ok):
            moves.append(_matrix(block.outer, "output", outer_part))
        return BlockPlan(block.path, rule, ctl, tuple(moves))
    stable = ctl == "scale" and (rule in (STABLE_RULE, OUTPUT_RULE) or k > 1) and block.stable_ok
    if ctl in ("linear", "experts") or stable:
        moves.append(_matrix(block.outer, "output", outer_part))
    if ctl == "scale":
        assert block.scale is not None
        moves.append(_vector(block.scale.param, "post_norm_scale"))
    elif ctl == "bias":
        assert block.norm is not None and block.norm.bias is not None
        moves.append(_vector(block.norm.bias, "post_norm_bias"))
    return BlockPlan(block.path, rule, ctl, tuple(moves), stable)


def _inner_part(block: MlpBlock, site: LinearSite) -> str:
    if site.experts:
        return "expert_input_bank"
    return "router" if site.node in block.routers else "inner_linear"


def _matrix(site: LinearSite, move: str, part: str) -> ParamMove:
    kind = "expert matrices" if site.experts else "matrix"
    return ParamMove(site.weight, site.module, move, kind, part, rank=1, site=site)


def _vector(param: str, part: str) -> ParamMove:
    return ParamMove(param, param.rsplit(".", 1)[0], "output", "vector", part, rank=0)


def check_in_time(view: GraphView, block: MlpBlock, param: str, after: str) -> None:
    """Check the graph reads ``param`` only after node ``after`` (else a patch comes late).

    Args:
        view: the graph.
        block: the block whose move changes ``param``.
        param: parameter name.
        after: fx node name where the move is computed (the MLP input, or an expert bank's ids).

    Raises:
        SolveError: the graph reads ``param`` at or before ``after``.
    """
    node = view.param_node[param]
    chain, stack = [], [node]  # the weight's casts and transposes, then their readers
    while stack:
        for u in stack.pop().users:
            if u not in view.input_dependent and u not in chain:
                chain.append(u)
                stack.append(u)
    readers = [u for d in [node, *chain] for u in d.users if u in view.input_dependent]
    at = view.index[view.by_name[after]]
    early = sorted((u for u in readers if view.index[u] <= at), key=view.index.__getitem__)
    if early:
        raise SolveError(
            block.path,
            f"the graph reads {param} (at {view.module_path(early[0]) or 'the model'}) "
            "before the block computes its patch: the solver cannot patch it in time",
        )


def checked_plan(view: GraphView, block: MlpBlock, update: str, k: int) -> BlockPlan:
    """The block's plan, once the solver is known to be able to follow it.

    Raises:
        SolveError: k > 1 on a block shape one scale cannot serve, or a moved parameter is
            read before the block computes its patch.
    """
    todo = plan(block, update, k)
    if k > 1 and update != LORA_RULE and (reason := multi_refusal(block, k)):
        raise SolveError(block.path, reason)
    for move in todo.input_moves:
        assert move.site is not None
        check_in_time(view, block, move.param, move.site.experts or block.mlp_in)
    for move in todo.output_moves:
        after = move.site.input if move.part == "attention_output" and move.site else block.mlp_in
        check_in_time(view, block, move.param, after)
    return todo


def multi_refusal(block: MlpBlock, k: int) -> str:
    """Why ``block`` cannot be matched at ``k > 1`` query positions, or ``""`` if it can.

    Decided from the block's shape alone, before any pass runs.
    """
    ctl = block.output_control
    if ctl == "bias":
        return (
            f"a post-norm bias adds one vector at every position and the norm's output has no "
            f"scale to share: it can match one query position, not {k} (query of {k} tokens)"
        )
    if ctl != "scale":
        return ""
    assert block.norm is not None
    if block.norm.centered:
        return (
            f"the post norm is a LayerNorm (centred): one shared scale for {k} query positions "
            "is solved for RMS norms only; use a single-token query"
        )
    if not block.stable_ok:
        return (
            "ops between the down projection and the post norm: the down projection cannot set "
            f"each of the {k} query positions' normalised output, and one scale alone matches "
            "one position; use a single-token query"
        )
    return ""
