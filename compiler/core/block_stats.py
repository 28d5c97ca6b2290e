"""The solver's figures for one block: what it did and how hard its conditions were."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockStats"]


@dataclass(frozen=True)
class BlockStats:
    """What the solver did at one block, with the figures of its conditions.

    A figure that does not apply to the block (a scale figure of a block without a post-norm
    scale, the gate sum of a dense block) is None, which ``report.json`` writes as null.

    Attributes:
        path: module path of the block.
        patched: False for blocks below the start layer, or left unpatched (``rejected``).
        rule: update rule applied (``standard``, ``stable`` or ``output``), or ``""``.
        output_control: ``linear``, ``scale``, ``bias`` or ``experts``.
        input_norm: ``||z||`` reached (smallest over positions); 0.0 for an unpatched block.
        input_change: ``max |z_C - z|`` before the move; 0.0 for an unpatched block.
        min_divisor: smallest ``|f_i|`` the scale move divided by (scale blocks).
        max_scale_change: largest ``|ds_i|`` (scale blocks).
        max_gain: largest ``|s_i + ds_i|`` (scale blocks).
        residual_error: ``max |y - y_C|`` after the patch, in the reduced pass.
        unreached: coordinates a low-precision zero ``f_i`` left unreached (scale blocks).
        max_unreached: the largest change such a coordinate missed.
        delta_norms: parameter name -> Frobenius norm of its delta.
        min_gate_sum: smallest gate sum ``S`` the experts' output move divided by (MoE).
        rejected: why the block was left unpatched (a failed condition), or ``""``.
        unreached_norm: the ``lora`` rule's miss, ``max_j ||y_j - y_C,j||`` after the block's
            patch (what its fixed post norm could not reach; the blocks above absorb it);
            None under the other rules.
        output_magnitude: behind a post norm, the factor on the reached MLP output's magnitude
            the patched output takes (the largest over query positions; MATH.md 12), else None.
        rounding_gain: the branch's first-order rounding beyond its output's own, per unit
            roundoff of the outer function's sums, relative to its largest output:
            ``max_i |dy_i/du_i| m_i / max_i |t_i|`` (MATH.md 12; 1 at most twice the
            unavoidable). It also bounds how the block passes on a relative perturbation of its
            input: what predicts the patched model's fidelity in another arithmetic (a
            reload, onnxruntime). None for a bias move or an unpatched block.
        reach_gap: the ``lora`` rule on a sandwich-norm block (MATH.md 10): 0.0 where the two
            projections reach ``y_C - x`` at every query position, else how far the nearest
            pair found stays from it (the largest over positions); None elsewhere.
    """

    path: str
    patched: bool
    rule: str
    output_control: str
    input_norm: float = 0.0
    input_change: float = 0.0
    min_divisor: float | None = None
    max_scale_change: float | None = None
    max_gain: float | None = None
    residual_error: float = 0.0
    unreached: int = 0
    max_unreached: float = 0.0
    delta_norms: dict[str, float] | None = None
    min_gate_sum: float | None = None
    rejected: str = ""
    unreached_norm: float | None = None
    output_magnitude: float | None = None
    rounding_gain: float | None = None
    reach_gap: float | None = None
