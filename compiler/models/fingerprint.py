"""Model fingerprints: which architecture and which weights a patch was computed on."""

from __future__ import annotations

import hashlib
import json

import torch

from ctxc.models.offload import read_param, read_rows

__all__ = ["SLAB_BYTES", "fingerprint"]

# Config keys that say how a model was loaded or saved, not what it computes.
_VOLATILE = {
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "quantization_config",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "architectures",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}
_SAMPLES = 8192
# Bytes of an offloaded parameter read at once while sampling it: a slab is in memory twice
# while it is read (the file's pages and the copy), so 64 MiB slabs made the fingerprint the
# offloaded compile's peak (+194 MiB on Gemma 3 270M; benchmarks/cost/offload.py).
SLAB_BYTES = 16 << 20


def fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """Hashes of a model's architecture and of its weights.

    ``arch`` covers the config (less loading details) and every parameter's name and shape.
    ``weights`` covers every parameter's dtype and a strided sample of its values (up to 8192
    elements each, always the first and last): it tells checkpoints and dtypes apart cheaply,
    without reading every weight.

    Args:
        model: a torch module, usually a Transformers model.

    Returns:
        ``{"arch": hex, "weights": hex}``.
    """
    arch = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
        arch.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    weights = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        arch.update(f"{name}:{tuple(param.shape)};".encode())
        sample = _sample(model, name, param)
        weights.update(f"{name}:{param.dtype};".encode())
        weights.update(sample.view(torch.uint8).numpy().tobytes())
    return {"arch": arch.hexdigest(), "weights": weights.hexdigest()}


def _sample(model: torch.nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """Every ``step``-th element of the flattened parameter and its last, on the CPU.

    An offloaded parameter is read from its store a slab of rows at a time (Gemma 3's
    embedding is 670 MB in float32): the same elements, never the whole tensor at once.
    """
    numel = param.numel()
    step = max(1, numel // _SAMPLES)
    if param.device.type != "meta" or param.dim() < 2:
        flat = read_param(model, name).reshape(-1)
        return torch.cat([flat[::step], flat[-1:]]).cpu().contiguous()
    row = numel // param.shape[0]
    slab = max(1, SLAB_BYTES // (row * param.element_size()))  # rows per read
    parts = []
    for start in range(0, param.shape[0], slab):
        stop = min(start + slab, param.shape[0])
        first = -(-start * row // step) * step  # the first sampled flat index in the slab
        flat = read_rows(model, name, start, stop).reshape(-1)
        parts.append(flat[first - start * row :: step].cpu().clone())  # not a view: frees the slab
        if stop == param.shape[0]:
            parts.append(flat[-1:].cpu().clone())
    return torch.cat(parts).contiguous()
