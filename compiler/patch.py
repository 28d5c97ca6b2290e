"""The Patch: per-parameter deltas as factors, with the metadata to apply them safely.

A patch stores each matrix delta as low-rank factors ``dW = u @ v.T`` and each vector delta
densely, all in float32. Applying it materialises ``(W.float() + dW).to(W.dtype)`` with
:meth:`Delta.materialize`, the same function the solver used, so the applied weights are bit for
bit those the solver computed with. Removing it restores the original tensors, which were kept
(subtracting would not be exact). Saved as safetensors, never pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ctxc.core.buffer_pool import BufferPool
from ctxc.core.delta_math import (
    add_in_float32,
    aligned_empty_like,
    at_alignment_of,
    lowrank_dense,
)
from ctxc.core.errors import CtxcError
from ctxc.core.vocabulary import PATCH_FILE
from ctxc.models.fingerprint import fingerprint
from ctxc.models.offload import ParamToken, put_param, read_param, restore_param

__all__ = [
    "FORMAT_VERSION",
    "Delta",
    "Patch",
    "PatchMeta",
    "metadata_digest",
    "stored_digest",
    "tensors_digest",
]

FORMAT_VERSION = "1"

# model -> {param name: its original (put_param's token)}; weak so a dropped model frees them.
_ORIGINALS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, ParamToken]] = (
    weakref.WeakKeyDictionary()
)


# Checks of a patch's tensors, their digest, and the canonical byte form of a patch file.
def check_tensor(key: str, t: torch.Tensor) -> None:
    """A stored factor must be float32 and finite."""
    if t.dtype != torch.float32:
        raise CtxcError(f"tensor {key!r} is {str(t.dtype).removeprefix('torch.')}, not float32")
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise CtxcError(f"tensor {key!r} has {bad} non-finite value(s) (NaN or Inf)")


def check_factors(d: Delta, query_tokens: int) -> None:
    """Internal consistency of a delta's factors (without a model).

    Args:
        d: the delta.
        query_tokens: the patch's query length. A solver's delta has rank at most the query
            length per move (or the matrix's own bound, ``min(out, in)``); a larger rank is no
            patch ctxc wrote.
    """
    if d.vector is not None:
        if d.vector.dim() != 1:
            raise CtxcError(f"tensor '{d.param}::vector' has shape {list(d.vector.shape)}, not [d]")
        return
    assert d.u is not None and d.v is not None
    dims = 3 if d.experts else 2
    if d.u.dim() != dims or d.v.dim() != dims:
        raise CtxcError(f"tensors '{d.param}::u'/'::v' are not {dims}-d factors")
    if d.u.shape[-1] != d.v.shape[-1]:
        raise CtxcError(
            f"tensors '{d.param}::u'/'::v' have ranks {d.u.shape[-1]} and {d.v.shape[-1]}"
        )
    if d.experts and not (d.u.shape[0] == d.v.shape[0] == len(d.experts)):
        raise CtxcError(f"tensor '{d.param}::u' does not hold one factor per listed expert")
    rank, bound = d.rank, max(min(d.u.shape[-2], d.v.shape[-2]), query_tokens)
    if not 1 <= rank <= bound:
        raise CtxcError(f"tensor '{d.param}::u' has rank {rank}, outside 1..{bound}")


def check_fits(d: Delta, shape: tuple[int, ...]) -> None:
    """A delta must have its parameter's shape (``shape``: the model's tensor)."""
    if d.vector is not None:
        got: tuple[int, ...] = tuple(d.vector.shape)
    else:
        assert d.u is not None and d.v is not None
        out_in = (int(d.u.shape[-2]), int(d.v.shape[-2]))
        matrix = out_in[::-1] if d.layout == "in_out" else out_in
        if d.experts:
            if len(shape) != 3 or not all(0 <= e < shape[0] for e in d.experts):
                raise CtxcError(f"tensor '{d.param}::u' names experts the parameter lacks")
            got = (shape[0], *matrix)
        else:
            got = matrix
    if got != shape:
        raise CtxcError(
            f"tensor {d.param!r}: delta shape {list(got)} differs from the model's {list(shape)}"
        )


def canonical(data: bytes) -> bytes:
    """A safetensors file with its JSON header in sorted key order (byte-identical per input)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a patch file's tensors: each name, dtype, shape and bytes, in name order.

    Stored in the file's metadata (``tensors_sha256``) and checked on load: a value changed
    after ctxc wrote it (a bit flip, an edit) is refused, however finite it is.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        head = [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        h.update(json.dumps(head).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def metadata_digest(metadata: dict[str, str]) -> str:
    """SHA-256 of a patch file's metadata but ``metadata_sha256`` itself, keys sorted.

    The metadata holds ``tensors_sha256``, so this digest covers the whole patch: the token ids,
    the rule, the fingerprint and the solver's figure as well as the factors. Stored as
    ``metadata_sha256`` and checked on load (issue 34: an edited ``query_ids`` was found only as
    a failed artefact check a minute later).
    """
    rest = {k: v for k, v in metadata.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def stored_digest(path) -> str | None:
    """The ``tensors_sha256`` a patch file's header holds (None: none), without loading it.

    Raises:
        OSError, ValueError: an unreadable file or header.
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: safetensors header of {n} bytes")
        header = json.loads(f.read(n))
    return header.get("__metadata__", {}).get("tensors_sha256")


@dataclass(frozen=True)
class Delta:
    """A change to one parameter.

    Attributes:
        param: parameter name (``model.layers.0.mlp.up_proj.weight``).
        block: module path of the block it belongs to.
        u: [out, r] float32, with ``v`` the factors of a matrix delta ``u @ v.T``.
        v: [in, r] float32.
        vector: [d] float32, a dense delta for a vector parameter.
        layout: ``"out_in"`` (``nn.Linear``) or ``"in_out"`` (Conv1D stores ``W.T``).
        experts: for a stacked expert bank (parameter [E, ., .]): the experts it changes, in
            order; ``u`` is then [n, out, r] and ``v`` [n, in, r], one pair per listed expert.
    """

    param: str
    block: str
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None
    vector: torch.Tensor | None = None
    layout: str = "out_in"
    experts: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        return 0 if self.u is None else int(self.u.shape[-1])

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The delta as a dense float32 tensor in the parameter's own layout (a matrix delta's
        computed into ``out``, a float32 [out, in] buffer: ``BufferPool.take_new``)."""
        if self.vector is not None:
            return self.vector
        assert self.u is not None and self.v is not None
        # [out, in] (or [n, out, in]: the listed experts' slices only)
        return lowrank_dense(self.u, self.v, self.layout, out=out)

    def materialize(
        self, base: torch.Tensor, aligned: bool = False, pool: BufferPool | None = None
    ) -> torch.Tensor:
        """``(base.float() + delta).to(base.dtype)``: the patched parameter value.

        Args:
            base: the parameter's value.
            aligned: the value at ``base``'s address modulo 64 bytes (``at_alignment_of``:
                what BLAS computes with a patch applied in place), written there directly.
            pool: the value is computed into a buffer taken from it (``BufferPool.take``, at
                that alignment: implies ``aligned``; the caller gives it back), and the dense
                delta into a temporary one given back here: the same ops, no new pages.

        Returns:
            the value (with ``pool``, the buffer taken).
        """
        if self.experts:
            w = base.detach().float().clone()  # [E, ., .]
            index = torch.tensor(self.experts, dtype=torch.long, device=base.device)
            w[index] = w[index] + self.dense().to(base.device)
            w = w.to(base.dtype)
            if pool is not None:
                buf = pool.take(base)
                buf.copy_(w)
                return buf  # the buffer itself: the caller gives it back
            return at_alignment_of(w, base) if aligned else w
        into = pool.take(base) if pool is not None else None
        if into is None and aligned:
            into = aligned_empty_like(base)
        scratch = None
        if pool is not None and self.u is not None and self.u.device == base.device:
            assert self.v is not None
            scratch = pool.take_new((self.u.shape[0], self.v.shape[0]), torch.float32, base.device)
        value = add_in_float32(base.detach(), self.dense(scratch).to(base.device), out=into)
        if pool is not None and scratch is not None:
            pool.give(scratch)
        return value if into is None else into

    def norm(self) -> float:
        """Frobenius norm of the delta (from the factors, without materialising)."""
        if self.vector is not None:
            return float(self.vector.norm())
        assert self.u is not None and self.v is not None
        gram = (self.u.mT @ self.u) * (self.v.mT @ self.v)  # [r, r] (or [n, r, r] for experts)
        return float(gram.sum().clamp_min(0).sqrt())


@dataclass(frozen=True)
class PatchMeta:
    """Where a patch came from and what it applies to."""

    fingerprint: dict[str, str]
    context_ids: list[int]
    query_ids: list[int]
    update: str
    dtype: str
    ctxc_version: str
    model: str = ""
    start_layer: int = 0
    # The solver pass's max |logit diff| from the full context: what an artefact of this
    # patch is expected to reproduce (ctxc.core.checks.gate). None: not recorded (older patches).
    solver_max_abs_logit_diff: float | None = None

    @property
    def baked(self) -> bool:
        """A fitted patch (``ctxc bake``: ``update`` is ``bake-<method>``), not an exact one."""
        return self.update.startswith("bake")


@dataclass
class Patch:
    """Per-parameter deltas for one context (and query), with their metadata.

    Attributes:
        deltas: parameter name -> :class:`Delta`, in graph order.
        meta: the :class:`PatchMeta`.
    """

    deltas: dict[str, Delta]
    meta: PatchMeta

    # -- application -------------------------------------------------------------------------

    def apply(self, model: torch.nn.Module, check: bool = True) -> None:
        """Write the patched weights into ``model`` in place, keeping the originals.

        Args:
            model: a model with the fingerprint this patch was computed on.
            check: compare fingerprints first (disable only for a model just checked).

        Raises:
            CtxcError: another fingerprint, or a patch already applied to this model.
        """
        if model in _ORIGINALS:
            raise CtxcError("a patch is already applied to this model: remove it first")
        if check:
            self.check(model)
        originals: dict[str, ParamToken] = {}
        with torch.no_grad():
            for name, delta in self.deltas.items():
                # In place where the parameter lives: its device, or its offload store.
                value = delta.materialize(read_param(model, name))
                originals[name] = put_param(model, name, value)
        _ORIGINALS[model] = originals

    def remove(self, model: torch.nn.Module) -> None:
        """Restore the original weights of ``model`` exactly (they were kept, not recomputed)."""
        originals = _ORIGINALS.pop(model, None)
        if originals is None:
            raise CtxcError("no patch is applied to this model")
        for name, token in originals.items():
            restore_param(model, name, token)

    @staticmethod
    def is_applied(model: torch.nn.Module) -> bool:
        return model in _ORIGINALS

    @contextmanager
    def applied(self, model: torch.nn.Module, check: bool = True) -> Iterator[torch.nn.Module]:
        """Apply the patch for the ``with`` body and always remove it afterwards.

        Args:
            model: as for :meth:`apply`.
            check: as for :meth:`apply`.

        Yields:
            ``model``, patched; its original weights are back when the body ends, however.
        """
        self.apply(model, check=check)
        try:
            yield model
        finally:
            self.remove(model)

    def check(self, model: torch.nn.Module) -> None:
        """Check that the patch fits ``model`` without applying it.

        Args:
            model: the model to patch.

        Raises:
            CtxcError: another fingerprint, a parameter the model lacks, a delta whose shape
                differs from its parameter's, or a rank past the parameter's dimensions; the
                message names the tensor.
        """
        got = fingerprint(model)
        if got != self.meta.fingerprint:
            key = "arch" if got["arch"] != self.meta.fingerprint["arch"] else "weights"
            what = {"arch": "architecture", "weights": "weights"}[key]
            raise CtxcError(
                f"patch does not fit this model: its {what} fingerprint differs "
                f"({self.meta.fingerprint[key][:12]} expected, {got[key][:12]} found)"
            )
        for name, delta in self.deltas.items():
            try:
                param = model.get_parameter(name)
            except AttributeError:
                raise CtxcError(f"patch tensor {name!r}: the model has no such parameter") from None
            check_fits(delta, tuple(param.shape))

    # -- figures -----------------------------------------------------------------------------

    def norms(self) -> dict[str, float]:
        """Frobenius norm of every delta, by parameter name."""
        return {name: d.norm() for name, d in self.deltas.items()}

    def blocks(self) -> dict[str, list[str]]:
        """Block module path -> names of the parameters patched in it."""
        out: dict[str, list[str]] = {}
        for name, d in self.deltas.items():
            out.setdefault(d.block, []).append(name)
        return out

    # -- storage -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the patch as safetensors (factors + JSON metadata). Returns the path."""
        path = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        index = []
        for name, d in self.deltas.items():
            if d.vector is not None:
                tensors[f"{name}::vector"] = d.vector.cpu().contiguous()
            else:
                assert d.u is not None and d.v is not None
                # Linears that read the same input share one v: store a copy per delta.
                tensors[f"{name}::u"] = d.u.cpu().contiguous().clone()
                tensors[f"{name}::v"] = d.v.cpu().contiguous().clone()
            entry: dict[str, str | list[int]] = {
                "param": name,
                "block": d.block,
                "layout": d.layout,
            }
            if d.experts:
                entry["experts"] = list(d.experts)
            index.append(entry)
        m = self.meta
        metadata = {
            "format": "ctxc-patch",
            "format_version": FORMAT_VERSION,
            "deltas": json.dumps(index),
            "fingerprint": json.dumps(m.fingerprint),
            "context_ids": json.dumps(m.context_ids),
            "query_ids": json.dumps(m.query_ids),
            "update": m.update,
            "dtype": m.dtype,
            "ctxc_version": m.ctxc_version,
            "model": m.model,
            "start_layer": str(m.start_layer),
            "tensors_sha256": tensors_digest(tensors),
        }
        if m.solver_max_abs_logit_diff is not None:
            metadata["solver_max_abs_logit_diff"] = repr(float(m.solver_max_abs_logit_diff))
        metadata["metadata_sha256"] = metadata_digest(metadata)
        # Written by Python, not safetensors' save_file: that creates the file 0600, ignoring the
        # umask, and writes the metadata in hash-map order, which differs between runs.
        path.write_bytes(canonical(save(tensors, metadata=metadata)))
        return path

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> Patch:
        """Read and validate a patch written by :meth:`save`.

        Args:
            path: ``patch.safetensors``, or a folder that holds one (a ``ctxc compile`` output).
            model: when given, the patch is also checked against it (:meth:`check`).

        Raises:
            CtxcError: the file is missing, is not a ctxc patch, or fails a check: a
                non-finite value, inconsistent factor shapes, a rank out of bounds, a malformed
                fingerprint (the one-line message names the tensor), or tensors or metadata
                that differ from the digests stored with them (the message names the file).
                A patch written before a digest existed loads without that check.
        """
        path = Path(path)
        if path.is_dir():
            if not (path / PATCH_FILE).is_file():
                raise CtxcError(f"patch folder {path} holds no {PATCH_FILE}")
            path = path / PATCH_FILE
        if not path.is_file():
            raise CtxcError(f"patch file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                md = f.metadata() or {}
                if md.get("format") != "ctxc-patch":
                    raise CtxcError(f"{path} is not a ctxc patch (no ctxc metadata)")
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except CtxcError:
            raise
        except Exception as exc:
            first = (str(exc).splitlines() or [""])[0]
            raise CtxcError(f"{path} is not a readable safetensors file: {first}") from exc
        try:
            patch = cls(_deltas(md, tensors), _meta(md))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise CtxcError(
                f"patch {path}: malformed metadata ({type(exc).__name__}: {exc})"
            ) from None
        except CtxcError as exc:
            raise CtxcError(f"patch {path}: {exc}") from None
        stored = md.get("tensors_sha256")  # absent in patches written before it existed
        if stored is not None and stored != tensors_digest(tensors):
            raise CtxcError(
                f"patch {path}: its tensors do not match the digest ctxc stored "
                "(the file was changed after it was written)"
            )
        whole = md.get("metadata_sha256")  # absent in patches written before it existed
        if whole is not None and whole != metadata_digest(md):
            raise CtxcError(
                f"patch {path}: its metadata (token ids, rule, fingerprint, ...) do not match "
                "the digest ctxc stored (the file was changed after it was written)"
            )
        if model is not None:
            patch.check(model)
        return patch


def _deltas(md: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, Delta]:
    """The validated deltas of a patch file's metadata and tensors."""
    deltas: dict[str, Delta] = {}
    used: set[str] = set()
    for entry in json.loads(md["deltas"]):
        name = entry["param"]
        common = {
            "param": name,
            "block": str(entry["block"]),
            "layout": entry["layout"],
            "experts": tuple(int(e) for e in entry.get("experts", ())),
        }
        if common["layout"] not in ("out_in", "in_out"):
            raise CtxcError(f"tensor {name!r}: unknown layout {common['layout']!r}")
        keys = [f"{name}::vector"] if f"{name}::vector" in tensors else [f"{name}::u", f"{name}::v"]
        for key in keys:
            if key not in tensors:
                raise CtxcError(f"tensor {key!r} is missing")
            check_tensor(key, tensors[key])
        used.update(keys)
        if len(keys) == 1:
            deltas[name] = Delta(vector=tensors[keys[0]], **common)
        else:
            deltas[name] = Delta(u=tensors[keys[0]], v=tensors[keys[1]], **common)
        check_factors(deltas[name], len(json.loads(md["query_ids"])))
    extra = sorted(set(tensors) - used)
    if extra:
        raise CtxcError(f"tensor {extra[0]!r} belongs to no listed delta")
    return deltas


def _meta(md: dict[str, str]) -> PatchMeta:
    """The validated :class:`PatchMeta` of a patch file's metadata."""
    fp = json.loads(md["fingerprint"])
    if not (
        isinstance(fp, dict)
        and set(fp) == {"arch", "weights"}
        and all(isinstance(v, str) and len(v) == 64 for v in fp.values())
    ):
        raise CtxcError("malformed fingerprint (two sha256 hex digests expected)")
    ids = {k: json.loads(md[k]) for k in ("context_ids", "query_ids")}
    for key, value in ids.items():
        if not (isinstance(value, list) and all(isinstance(i, int) and i >= 0 for i in value)):
            raise CtxcError(f"malformed {key} (a list of token ids expected)")
    if not ids["query_ids"]:
        raise CtxcError("empty query_ids")
    return PatchMeta(
        fingerprint=fp,
        context_ids=ids["context_ids"],
        query_ids=ids["query_ids"],
        update=md["update"],
        dtype=md["dtype"],
        ctxc_version=md["ctxc_version"],
        model=md.get("model", ""),
        start_layer=int(md.get("start_layer", "0")),
        solver_max_abs_logit_diff=(
            float(md["solver_max_abs_logit_diff"]) if "solver_max_abs_logit_diff" in md else None
        ),
    )
