"""Models dispersed by accelerate's big-model inference: their weights where they live.

``from_pretrained(device_map=..., max_memory=..., offload_folder=...)`` puts each block on a
GPU, on the CPU or on disk; an offloaded parameter is a ``meta`` tensor in the model and its
value sits in the store of an accelerate hook (``_hf_hook.weights_map``: the checkpoint's own
safetensors files, or files accelerate wrote). This module is ctxc's one door to that store:

- :func:`meta_skeleton`: the model rebuilt on the meta device, traced instead of the model, so
  tracing never holds a second copy of the weights (``torch.export`` only reads shapes);
- :func:`weight_source`: what each graph input is in a run: the model's own tensor where it
  lives, or a :class:`~ctxc.models.placement.LazyWeight` read from the store at use;
- :func:`read_param`, :func:`put_param`, :func:`restore_param`: a parameter's value, and a
  patched value written where the parameter lives (in place on its device, or into a file of
  ctxc's own that the store is pointed at: the checkpoint is never written), and undone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch

from ctxc.models.placement import LazyWeight

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_ALIGN = 64  # bytes: the widest SIMD load the CPU BLAS kernels peel for (delta_math.py)

__all__ = [
    "ParamToken",
    "execution_device",
    "input_device",
    "is_dispersed",
    "meta_skeleton",
    "pad_header",
    "put_param",
    "read_param",
    "read_rows",
    "restore_param",
    "safetensors_header",
    "store_file",
    "stored_range",
    "weight_source",
]


def is_dispersed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are offloaded (meta) or spread over several devices."""
    devices = {p.device for p in model.parameters()}
    return len(devices) > 1 or any(d.type == "meta" for d in devices)


class _OffloadStore(Protocol):
    """What ctxc reads and writes of accelerate's ``OffloadedWeightsLoader`` (accelerate ships
    no types): tensors kept in memory, and where each of the others is read from."""

    state_dict: dict[str, torch.Tensor]
    # key -> {"safetensors_file", "weight_name", "dtype"} (those a file entry has)
    index: dict[str, dict[str, str]]

    def __getitem__(self, key: str) -> torch.Tensor: ...


# put_param's token for restore_param: the original tensor, a store's in-memory original, or
# its original index entry and the file ctxc wrote.
ParamToken = (
    torch.Tensor
    | tuple[Literal["state"], torch.Tensor]
    | tuple[Literal["index"], dict[str, str], str]
)


def _hook_of(model: torch.nn.Module, name: str) -> tuple[Any, str]:
    """(the accelerate hook whose store holds ``name``, the name relative to its module)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:cut])
        hook = getattr(model.get_submodule(prefix), "_hf_hook", None)
        if hook is not None and getattr(hook, "weights_map", None) is not None:
            return hook, ".".join(parts[cut:])
    raise ValueError(f"{name} is on the meta device but no accelerate hook stores it")


def execution_device(model: torch.nn.Module, name: str) -> torch.device:
    """Where the ops that read parameter ``name`` run (its hook's execution device)."""
    param = model.get_parameter(name)
    if param.device.type != "meta":
        return param.device
    hook, _ = _hook_of(model, name)
    device = hook.execution_device
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def input_device(model: torch.nn.Module) -> torch.device:
    """The device the input ids go to: the input embedding's (execution) device."""
    if not is_dispersed(model):
        return next(model.parameters()).device
    # Only Transformers' from_pretrained disperses a model: it has input embeddings.
    embed = cast("PreTrainedModel", model).get_input_embeddings()
    if embed is not None and getattr(embed, "weight", None) is not None:
        name = next(n for n, p in model.named_parameters() if p is embed.weight)
        return execution_device(model, name)
    return next(model.parameters()).device


def _store(model: torch.nn.Module, name: str) -> tuple[_OffloadStore, str]:
    """(the OffloadedWeightsLoader holding ``name``, its key there)."""
    hook, rel = _hook_of(model, name)
    weights = hook.weights_map
    prefix = getattr(weights, "prefix", "")
    return getattr(weights, "dataset", weights), prefix + rel


def _fetch(model: torch.nn.Module, name: str, device: torch.device) -> Callable:
    """``fetch(rows)`` for an offloaded parameter: all of it, or a range of its rows."""
    from safetensors import safe_open

    def fetch(rows: tuple[int, int] | None) -> torch.Tensor:
        loader, key = _store(model, name)
        info = loader.index.get(key, {}) if key not in loader.state_dict else {}
        if rows is None or "safetensors_file" not in info:
            value = loader[key]
            value = value if rows is None else value[rows[0] : rows[1]]
        else:  # read only the rows asked for (the head over a 262k vocabulary)
            # A copy, so that nothing keeps the file's mapping: without it an embedding lookup
            # (one slice per id) held 244 MiB more of Gemma 3's file resident (RssFile) at its
            # peak, the offloaded compile's whole peak (benchmarks/cost/offload.py: 988 -> 776 MiB).
            with safe_open(info["safetensors_file"], framework="pt") as f:
                value = f.get_slice(info.get("weight_name", key))[rows[0] : rows[1]].clone()
            if "dtype" in info:
                value = value.to(getattr(torch, info["dtype"]))
        return value.to(device)

    return fetch


def weight_source(model: torch.nn.Module) -> Callable[[str, object], object]:
    """``source(name, traced value)`` -> what a run of a dispersed model's graph reads.

    Args:
        model: the dispersed model (the graph was traced on its :func:`meta_skeleton`).

    Returns:
        a function of a state name (as in ``model.state_dict()``) and the export's own value:
        the model's tensor where it lives, a :class:`LazyWeight` for an offloaded parameter,
        or the export's value (a constant traced from the skeleton's real buffers).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))

    def source(name: str, traced: object) -> object:
        value = params.get(name)
        if value is None:
            buffer = buffers.get(name)
            return traced if buffer is None or buffer.device.type == "meta" else buffer
        if value.device.type != "meta":
            return value
        device = execution_device(model, name)
        fetch = _fetch(model, name, device)
        return LazyWeight(name, tuple(value.shape), value.dtype, device, fetch)

    return source


def meta_skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` rebuilt from its config with every parameter on the meta device (no hooks).

    Buffers are real (rotary frequencies, embedding scales: computed from the config, as the
    model's are), so the constants ``torch.export`` lifts from them hold values.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = model.config
    kwargs = {"dtype": next(model.parameters()).dtype}
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config, **kwargs)
    return skeleton.eval()


def read_param(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Parameter ``name``'s value: the tensor itself, or read from its offload store."""
    param = model.get_parameter(name)
    if param.device.type != "meta":
        return param.detach()
    loader, key = _store(model, name)
    return loader[key]


def read_rows(model: torch.nn.Module, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of parameter ``name``, read alone from its store when offloaded."""
    param = model.get_parameter(name)
    if param.device.type != "meta":
        return param.detach()[start:stop]
    return _fetch(model, name, torch.device("cpu"))((start, stop))


def store_file(model: torch.nn.Module, name: str) -> tuple[str, str] | None:
    """(safetensors file, tensor name) an offloaded parameter is read from, or None."""
    if model.get_parameter(name).device.type != "meta":
        return None
    loader, key = _store(model, name)
    info = {} if key in loader.state_dict else loader.index.get(key, {})
    if "safetensors_file" not in info:
        return None
    return info["safetensors_file"], info.get("weight_name", key)


def stored_range(model: torch.nn.Module, name: str, dtype: str) -> tuple[str, int, int] | None:
    """(file, byte offset, byte count) of offloaded tensor ``name``'s value as its store keeps it.

    Args:
        model: the dispersed model.
        name: a parameter or buffer on the meta device.
        dtype: the safetensors dtype (``F32``, ``BF16``...) it is wanted in.

    Returns:
        the range, or None when the store does not keep it as the model holds it (another
        dtype or shape: the loader converts at each read), or keeps it in memory.
    """
    loader, key = _store(model, name)
    info = {} if key in loader.state_dict else loader.index.get(key, {})
    if "safetensors_file" not in info:
        return None
    path = info["safetensors_file"]
    n, header = safetensors_header(path)
    entry = header[info.get("weight_name", key)]
    dispersed = cast("PreTrainedModel", model)  # from_pretrained's: a Transformers model
    shape = list(dispersed.get_parameter_or_buffer(name).shape)
    if entry["dtype"] != dtype or entry["shape"] != shape:
        return None
    begin, end = entry["data_offsets"]
    return path, 8 + n + begin, end - begin


def safetensors_header(path: str) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, read without its data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def pad_header(path: str, shift: int) -> None:
    """Move every tensor of a safetensors file ``shift`` bytes on (mod 64), in place.

    The header is rewritten compactly and padded with spaces, which the format allows; a tensor
    memory-mapped from the file then sits at another address modulo 64, where CPU kernels round
    as they did for the weights the solver computed with (``at_alignment_of``). The data is
    copied a megabyte at a time, never read whole.
    """
    n, header = safetensors_header(path)
    raw = json.dumps(header, separators=(",", ":")).encode()
    pad = (n + shift - len(raw)) % _ALIGN
    tmp = path + ".realign"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(8 + n)
        dst.write(struct.pack("<Q", len(raw) + pad) + raw + b" " * pad)
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, path)


def _address(path: str, name: str) -> int:
    """A tensor's address modulo 64 when its safetensors file is memory-mapped."""
    n, header = safetensors_header(path)
    return (8 + n + header[name]["data_offsets"][0]) % _ALIGN


def put_param(model: torch.nn.Module, name: str, value: torch.Tensor) -> ParamToken:
    """Write ``value`` as parameter ``name`` where it lives; a token for :func:`restore_param`.

    A parameter on a device is overwritten in place (its original is kept, cloned). An
    offloaded one's store entry is pointed at a safetensors file ctxc writes (or, for a store
    held in memory, replaced): the checkpoint the store reads from is never written.
    """
    param = model.get_parameter(name)
    if param.device.type != "meta":
        original = param.detach().clone()
        with torch.no_grad():
            param.copy_(value)
        return original
    from safetensors.torch import save_file

    loader, key = _store(model, name)
    if key in loader.state_dict:
        old = loader.state_dict[key]
        loader.state_dict[key] = value.detach().to(old.device)
        return ("state", old)
    handle, path = tempfile.mkstemp(prefix="ctxc-patched-", suffix=".safetensors")
    os.close(handle)
    save_file({key: value.detach().cpu().contiguous()}, path)
    entry = loader.index[key]
    if "safetensors_file" in entry:  # at the address the solver computed with
        want = _address(entry["safetensors_file"], entry.get("weight_name", key))
        pad_header(path, (want - _address(path, key)) % _ALIGN)
    loader.index[key] = {
        "safetensors_file": path,
        "weight_name": key,
        "dtype": str(value.dtype).removeprefix("torch."),
    }
    return ("index", entry, path)


def restore_param(model: torch.nn.Module, name: str, token: ParamToken) -> None:
    """Undo :func:`put_param` exactly (the original was kept, not recomputed)."""
    if isinstance(token, torch.Tensor):
        with torch.no_grad():
            model.get_parameter(name).copy_(token)
        return
    loader, key = _store(model, name)
    if token[0] == "state":
        loader.state_dict[key] = token[1]
        return
    loader.index[key] = token[1]
    with contextlib.suppress(OSError):
        os.unlink(token[2])
