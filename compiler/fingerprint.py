"""Model fingerprints: which architecture and which weights a patch was computed on."""

from __future__ import annotations

import hashlib
import json

import torch

from ctxc.offload import read_param

__all__ = ["fingerprint"]

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
        flat = read_param(model, name).reshape(-1)  # offloaded: read from its store
        step = max(1, flat.numel() // _SAMPLES)
        sample = torch.cat([flat[::step], flat[-1:]]).cpu().contiguous()
        weights.update(f"{name}:{param.dtype};".encode())
        weights.update(sample.view(torch.uint8).numpy().tobytes())
    return {"arch": arch.hexdigest(), "weights": weights.hexdigest()}
