"""``ctxc.bake.statistics``: a thought patch as sums over its fit positions, chunk by chunk.

The default fit (:func:`~ctxc.passes.solver.fit_solve.fit_solve`) is sequential: each block is
fitted on the run patched by every block before it, and its post-norm scales are fitted after
its linear moves; a block's statistics depend on the patch so far, so they do not add up over
chunks. ``method="additive"`` fits each block from values that no patch changes: a
teacher-forced run (the no-context run whose residual stream is set, at every fitted position,
to the full run's block output before the next block starts), its linear moves only:

- a block with an attention surface (sandwich norms, :attr:`BakeOptions.moves_attention`): the
  attention output projection, from the attention output ``a`` to each position's stable
  unit-RMS target for the full run's ``v_C`` (as the sequential fit's first move); the MLP then
  sees ``v_C``, needs no move and gets none;
- else the inner linears (``z -> W (z_C - z)``) and the outer one, from the activation the MLP
  makes of the full run's ``z_C`` to what the block output needs (``y_C``, through the post
  norm's stable target where there is one).

Each linear's reduced-rank ridge fit needs only ``X^T X``, ``X^T Y`` and ``||Y||^2`` summed over
its fitted rows (:func:`solve_site` is :func:`~ctxc.passes.solver.fit_moves.fit_linear` from
them), so a chunk's statistics add to the others' and subtract again: ``stats.safetensors``
keeps the sums (float64) beside the patch, with each chunk's fit data (its ids) to recompute
its share when it is removed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ctxc.bake.data import FitData
from ctxc.core.errors import CtxcError, SolveError
from ctxc.core.options import BakeOptions
from ctxc.passes.locate.block_map import BlockMap, LinearSite, MlpBlock
from ctxc.passes.runtime.run_graph import BlockTargets
from ctxc.passes.solver import block_moves as moves
from ctxc.passes.solver.fit_moves import residual_from_sums, stable_targets
from ctxc.passes.solver.fit_solve import Lockstep
from ctxc.patch import Delta

__all__ = [
    "STATS_FILE",
    "Chunk",
    "SiteFit",
    "Statistics",
    "chunk_id",
    "gather",
    "solve",
    "solve_site",
]

STATS_FILE = "stats.safetensors"
_PARTS = ("gram", "cross", "energy", "count")  # X^T X [in, in], X^T Y [in, out], ||Y||^2, rows


def chunk_id(context_ids: Sequence[int]) -> str:
    """A chunk's id: the first 12 hex digits of the SHA-256 of its context's token ids."""
    return hashlib.sha256(json.dumps([int(i) for i in context_ids]).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Chunk:
    """One context chunk of an additive patch: what its statistics were gathered from.

    Attributes:
        id: :func:`chunk_id` of its context.
        name: where it came from (the ``--context`` file's name), for the report.
        data: its fit data (context, prefix and fit query ids): its share of the sums is
            gathered again from them when the chunk is removed.
    """

    id: str
    name: str
    data: FitData

    def to_dict(self) -> dict:
        """The JSON form kept in ``stats.safetensors``' metadata."""
        return {"id": self.id, "name": self.name, "data": asdict(self.data)}

    @staticmethod
    def from_dict(d: dict) -> Chunk:
        """The inverse of :meth:`to_dict`."""
        return Chunk(d["id"], d["name"], FitData(**d["data"]))


@dataclass(frozen=True)
class Statistics:
    """The sums an additive patch is solved from, and the chunks they sum.

    Attributes:
        sums: ``<weight>:<part>`` -> float64 tensor, parts :data:`_PARTS` per moved linear.
        sites: weight name -> ``{"block": path, "layout": layout}`` (how its delta is made).
        chunks: the chunks summed, in the order added.
        options: the :class:`BakeOptions` (as a dict) every chunk was gathered and is solved
            with.
    """

    sums: dict[str, torch.Tensor]
    sites: dict[str, dict]
    chunks: tuple[Chunk, ...]
    options: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[str]:
        """The chunks' ids, in order."""
        return [c.id for c in self.chunks]

    def plus(self, other: Statistics) -> Statistics:
        """These sums and ``other``'s (its chunks after these).

        Raises:
            CtxcError: a chunk already summed here, or sums of other linears or options.
        """
        again = sorted(set(self.ids) & set(other.ids))
        if again:
            raise CtxcError(f"chunk {again[0]} is in the patch already (same context ids)")
        self._check_same(other)
        sums = {k: v + other.sums[k] for k, v in self.sums.items()}
        return Statistics(sums, self.sites, self.chunks + other.chunks, self.options)

    def minus(self, other: Statistics) -> Statistics:
        """These sums without ``other``'s, whose chunks must be among these."""
        self._check_same(other)
        gone = set(other.ids)
        sums = {k: v - other.sums[k] for k, v in self.sums.items()}
        kept = tuple(c for c in self.chunks if c.id not in gone)
        return Statistics(sums, self.sites, kept, self.options)

    def _check_same(self, other: Statistics) -> None:
        if set(self.sums) != set(other.sums) or self.options != other.options:
            raise CtxcError("the statistics were gathered with other options or on other linears")

    def save(self, path: Path) -> None:
        """Write the sums and their record (sites, chunks, options) as one safetensors file."""
        from safetensors.torch import save_file

        record = {
            "sites": self.sites,
            "chunks": [c.to_dict() for c in self.chunks],
            "options": self.options,
        }
        tensors = {k: v.contiguous() for k, v in self.sums.items()}
        save_file(tensors, str(path), metadata={"ctxc_statistics": json.dumps(record)})

    @staticmethod
    def load(path: Path) -> Statistics:
        """Read a file :meth:`save` wrote.

        Raises:
            CtxcError: no such file, or not a statistics file.
        """
        from safetensors import safe_open

        if not path.is_file():
            raise CtxcError().naming(
                "{} has no {}: only a {method} additive bake keeps the statistics chunks add "
                "to (the default fit is sequential)",
                path.parent,
                STATS_FILE,
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                record = json.loads(meta["ctxc_statistics"])
                sums = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        except (OSError, KeyError, ValueError) as exc:
            raise CtxcError(f"{path} is not a ctxc statistics file ({exc})") from None
        chunks = tuple(Chunk.from_dict(c) for c in record["chunks"])
        return Statistics(sums, record["sites"], chunks, record["options"])


class _ForcedRuns(Lockstep):
    """The fit's lockstep runs (:class:`~ctxc.passes.solver.fit_solve.Lockstep`), whose computed
    values can also be set (teacher forcing). Mutates only the runs."""

    def __init__(self, traced, queries: Sequence[torch.Tensor], keep: set[str]):
        super().__init__(traced, queries, keep)
        self.sizes = [int(q.shape[-1]) for q in queries]

    def force(self, name: str, rows: torch.Tensor, where: torch.Tensor) -> None:
        """Set a computed node's value to ``rows`` [N, d] at the rows ``where`` [N] marks (the
        nodes computed after it read the new value)."""
        node = self.view.by_name[name]
        start = 0
        for run, k in zip(self.runs, self.sizes, strict=True):
            now = run.value(node)
            flat = now.reshape(-1, now.shape[-1])
            mask = where[start : start + k, None]
            new = torch.where(mask, rows[start : start + k].to(flat.dtype), flat)
            run.env[node] = new.reshape(now.shape)
            if node in run.kept:
                run.kept[node] = run.env[node].clone()
            start += k


class _Gatherer:
    """Adds each block's (X, Y) pairs of one chunk into the sums."""

    def __init__(self, runs: _ForcedRuns, targets: dict[str, BlockTargets], rows, attention):
        self.runs, self.targets, self.rows, self.attention = runs, targets, rows, attention
        self.sums: dict[str, torch.Tensor] = {}
        self.sites: dict[str, dict] = {}

    def block(self, block: MlpBlock) -> None:
        tg = self.targets[block.path]
        if self.attention and block.attention is not None:
            self._attention(block, tg)
        else:
            self._mlp(block, tg)
        self.runs.advance(block.residual_add)
        self.runs.force(block.residual_add, tg.y, self.rows)  # the next block's input: y_C
        self.runs.drop_before(block.residual_add)

    def _attention(self, block: MlpBlock, tg: BlockTargets) -> None:
        att = block.attention
        assert att is not None
        if tg.v is None:
            raise SolveError(block.path, "no full-run value of the residual after the attention")
        self.runs.advance(att.add)
        x = self._fit(self.runs.values(att.residual))  # [N', d]
        a = self._fit(self.runs.values(att.site.input))  # [N', d_attn]
        t = (self._fit(tg.v).float() - x) / att.gain  # what s_a * norm(W_o a) must become
        sc = att.scale
        s = sc.alpha * self.runs.param(sc.param).float() + sc.offset  # [d]
        o_now = self._outer_now(att.site, a)
        self._add(block.path, att.site, a, stable_targets(s, t, o_now) - o_now)

    def _mlp(self, block: MlpBlock, tg: BlockTargets) -> None:
        sites = [s for s in block.inner if not s.experts]
        if len(sites) != len(block.inner) or block.output_control not in ("linear", "scale"):
            raise SolveError(
                block.path,
                f"the additive fit moves linears only; this block's output is set by its "
                f"{block.output_control} (or an expert bank): bake it with the default fit",
            )
        self.runs.advance(block.mlp_in)
        z = self._fit(self.runs.values(block.mlp_in))  # [N', d_in]
        z_c = self._fit(tg.z).float()
        for site in sites:
            self._add(block.path, site, z, (z_c - z) @ self._weight(site).T)
        self.runs.force(block.mlp_in, tg.z, self.rows)  # the MLP as the inner moves make it
        self.runs.advance(block.residual_add)
        tail = [(s, self.runs.values(s.side) if s.side else None) for s in block.tail]
        t = self._fit(moves.control_target(tg.y, tail))  # [N', d]
        h = self._fit(self.runs.values(block.activation))  # [N', d_ff]
        u_now = self._outer_now(block.outer, h)
        if block.output_control == "scale":
            sc = block.scale
            if sc is None or not block.stable_ok:
                raise SolveError(block.path, "ops between the down projection and the post norm")
            s = sc.alpha * self.runs.param(sc.param).float() + sc.offset
            self._add(block.path, block.outer, h, stable_targets(s, t, u_now) - u_now)
        else:
            self._add(block.path, block.outer, h, t - u_now)

    def _fit(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()[self.rows]

    def _weight(self, site: LinearSite) -> torch.Tensor:
        w = self.runs.param(site.weight).float()
        return w.T if site.layout == "in_out" else w  # [out, in]

    def _outer_now(self, site: LinearSite, x: torch.Tensor) -> torch.Tensor:
        out = x @ self._weight(site).T
        return out + self.runs.param(site.bias).float() if site.bias is not None else out

    def _add(self, path: str, site: LinearSite, x: torch.Tensor, y: torch.Tensor) -> None:
        xd, yd = x.double(), y.double()  # [N', in], [N', out]
        part = {
            "gram": xd.T @ xd,
            "cross": xd.T @ yd,
            "energy": yd.pow(2).sum().reshape(()),
            "count": torch.tensor(float(xd.shape[0]), dtype=torch.float64),
        }
        for k, v in part.items():
            key = f"{site.weight}:{k}"
            self.sums[key] = self.sums[key] + v if key in self.sums else v
        self.sites[site.weight] = {"block": path, "layout": site.layout}


def gather(
    traced,
    blocks: BlockMap,
    targets: dict[str, BlockTargets],
    data: FitData,
    rows: torch.Tensor,
    options: BakeOptions,
    name: str = "",
    on_block: Callable[[int, int, str], None] | None = None,
) -> Statistics:
    """One chunk's statistics: its teacher-forced runs' (X, Y) pairs, summed per linear.

    Args:
        traced: the exported model.
        blocks: its blocks, in graph order.
        targets: the full runs' targets of ``data`` (:func:`~ctxc.bake.targets.cached_fit_targets`).
        data: the chunk's fit data.
        rows: [N] bool, its fitted positions (the others are run, not forced, not summed).
        options: the bake's options (the attention surface: ``moves_attention``).
        name: the chunk's name for the report.
        on_block: progress callback ``(done, total, block path)``.

    Returns:
        the :class:`Statistics` of this one chunk.

    Raises:
        SolveError: a block the additive fit cannot move (one line, with the block).
    """
    queries = [torch.tensor([data.reduced(i)]) for i in range(len(data.queries))]
    keep = set().union(*(moves.output_reads(b) for b in blocks.blocks))
    keep.update(b.mlp_in for b in blocks.blocks)
    gatherer = _Gatherer(_ForcedRuns(traced, queries, keep), targets, rows, options.moves_attention)
    with torch.no_grad():
        for i, block in enumerate(blocks.blocks):
            gatherer.block(block)
            if on_block is not None:
                on_block(i + 1, len(blocks.blocks), block.path)
    chunk = Chunk(chunk_id(data.context_ids), name, data)
    return Statistics(gatherer.sums, gatherer.sites, (chunk,), asdict(options))


@dataclass(frozen=True)
class SiteFit:
    """One linear's fit from its sums.

    Attributes:
        u: [out, r] float32.
        v: [in, r] float32.
        rel_residual: ``||X dW^T - Y|| / ||Y||`` over the summed rows.
    """

    u: torch.Tensor
    v: torch.Tensor
    rel_residual: float


def solve_site(
    gram: torch.Tensor,
    cross: torch.Tensor,
    energy: float,
    count: int,
    ridge: float,
    rank: int | None,
) -> SiteFit:
    """The reduced-rank ridge fit of :func:`~ctxc.passes.solver.fit_moves.fit_linear` from
    ``X^T X``, ``X^T Y`` and ``||Y||^2`` alone.

    ``dW^T = B P``: ``B = (X^T X + lam I)^+ X^T Y`` (``lam = ridge ||X||_F^2 / in``), ``P`` the
    projection on the top-``rank`` right singular vectors of the fitted values ``X B``, found
    from ``G^(1/2) B`` (``G = X^T X = Q L Q^T``, ``(X B)^T X B = (L^(1/2) Q^T B)^T (...)``).

    Args:
        gram: ``X^T X`` [in, in], float64.
        cross: ``X^T Y`` [in, out], float64.
        energy: ``||Y||_F^2``.
        count: N, the rows summed (the rank is at most ``min(N, in, out)``).
        ridge: relative ridge.
        rank: rank budget (None: none).

    Raises:
        CtxcError: ``X`` is zero at every row.
    """
    d_in, d_out = cross.shape
    trace = float(gram.diagonal().sum())
    if trace <= 0.0:
        raise CtxcError(f"the input is zero at all {count} fitted positions: nothing to move")
    lam = ridge * trace / d_in
    evals, q = torch.linalg.eigh(gram)  # ascending
    keep = evals > evals.max().clamp_min(0) * d_in * torch.finfo(gram.dtype).eps
    if lam > 0:
        b = q @ ((q.T @ cross) / (evals.clamp_min(0) + lam)[:, None])  # [in, out]
    else:  # the minimum-norm solution: the null space dropped
        inv = torch.where(keep, 1.0 / torch.where(keep, evals, torch.ones_like(evals)), 0.0)
        b = q @ (inv[:, None] * (q.T @ cross))
    m = evals.clamp_min(0).sqrt()[:, None] * (q.T @ b)  # [in, out]: m^T m = (X b)^T (X b)
    full = min(count, d_in, d_out)
    r = full if rank is None else min(rank, full)
    _, sv, vh = torch.linalg.svd(m, full_matrices=False)  # vh [min(in, out), out]
    ok = sv[:r] > sv.max() * 1e-12 if sv.numel() else sv[:r] > 0
    basis = vh[:r][ok].T  # [out, r']
    if basis.shape[1] == 0:  # nothing to fit: a zero delta of rank 1 keeps the file valid
        basis = torch.zeros(d_out, 1, dtype=gram.dtype)
        basis[0, 0] = 1.0
    v = b @ basis  # [in, r']
    rel = residual_from_sums(gram, cross, basis, v, energy)
    return SiteFit(basis.float().contiguous(), v.float().contiguous(), rel)


def solve(stats: Statistics, ridge: float, rank: int | None) -> tuple[dict[str, Delta], dict]:
    """Every moved linear's delta from ``stats``.

    Returns:
        ``(deltas, residuals)``: weight name -> :class:`Delta`, in the order first gathered;
        weight name -> its fit's relative residual.

    Raises:
        SolveError: a linear whose input is zero at every fitted position.
    """
    deltas: dict[str, Delta] = {}
    residuals: dict[str, float] = {}
    for param, site in stats.sites.items():
        s = {p: stats.sums[f"{param}:{p}"] for p in _PARTS}
        try:
            fit = solve_site(
                s["gram"], s["cross"], float(s["energy"]), round(float(s["count"])), ridge, rank
            )
        except CtxcError as exc:
            raise SolveError(site["block"], f"{param}: {exc}") from None
        deltas[param] = Delta(param, site["block"], u=fit.u, v=fit.v, layout=site["layout"])
        residuals[param] = fit.rel_residual
    return deltas, residuals
