"""What the locator finds: residual MLP blocks, their parts, and the candidates it rejects."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockMap", "LinearSite", "MlpBlock", "Rejection", "ScaleSite"]


@dataclass(frozen=True)
class LinearSite:
    """A linear map applied to an activation, with the parameter that holds its weight.

    Attributes:
        node: fx node computing the product (internal; not part of stable reports).
        input: fx node of the tensor the weight multiplies.
        weight: parameter name, as in ``model.state_dict()``.
        bias: parameter name of the bias, or None.
        module: module path of the linear (``model.layers.0.mlp.up_proj``).
        layout: ``"out_in"`` for ``nn.Linear`` ([out, in]); ``"in_out"`` for GPT-2's Conv1D.
    """

    node: str
    input: str
    weight: str
    bias: str | None
    module: str
    layout: str = "out_in"


@dataclass(frozen=True)
class ScaleSite:
    """An element-wise trainable scale ``s = alpha * w + offset`` applied to a normalised tensor.

    Attributes:
        node: fx node of the product ``normalized * s``.
        normalized: fx node of the tensor the scale multiplies.
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
class MlpBlock:
    """A residual block ``y = v + g(f(v))`` with an MLP branch.

    Attributes:
        path: module path of the MLP (``model.layers.0.mlp``).
        residual_in: fx node ``v``, the residual stream entering the add.
        residual_add: fx node ``y = v + branch``.
        branch: fx node of the branch output added to ``v``.
        mlp_in: fx node ``z`` that every inner linear reads (input-controllable).
        inner: the inner linears (gate and up; fc_in).
        activation: fx node ``h``, the outer linear's input.
        outer: the outer linear (down projection; fc_out).
        post_norm: module path of a norm between the outer linear and the add, or None.
        scale: the post norm's trainable scale, if it has one.
        gain: constant factor between the outer function's output and the add (Granite).
        output_control: ``"scale"`` (post-norm scale) or ``"linear"`` (outer linear).
    """

    path: str
    residual_in: str
    residual_add: str
    branch: str
    mlp_in: str
    inner: tuple[LinearSite, ...]
    activation: str
    outer: LinearSite
    post_norm: str | None = None
    scale: ScaleSite | None = None
    gain: float = 1.0
    output_control: str = "linear"

    @property
    def patched_params(self) -> tuple[str, ...]:
        """Parameter names the solver may change, inner first."""
        names = [s.weight for s in self.inner] + [self.outer.weight]
        if self.scale is not None:
            names.append(self.scale.param)
        return tuple(names)


@dataclass(frozen=True)
class Rejection:
    """A candidate block that admits no exact patch, and why."""

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
    """

    blocks: tuple[MlpBlock, ...]
    rejections: tuple[Rejection, ...] = ()
    head: str | None = None
    notes: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.blocks)
