"""A dispersed model's folder written shard by shard, each weight copied from where it lives.

``save_pretrained`` gathers each shard of an offloaded model in memory (Transformers'
``load_offloaded_parameter``): a tensor bigger than a block (Gemma 3's 670 MB embedding) is
read whole. :func:`write_shards` writes the same shards (Transformers' split, safetensors'
tensor order) without reading any weight whole: a weight its store keeps as the model holds it
(the checkpoint's own file, or the file ``Patch.apply`` wrote a patched weight to) is copied
byte for byte in chunks with ``read``/``write`` (pages read that way go to the page cache, not
to the process, as a memory map's would); any other (on a device, or converted at each read) is
written a few rows at a time.

Alignment: CPU BLAS kernels round differently at another address modulo 64 bytes, and the
solver computed each patched weight at the address the model held it (``at_alignment_of``;
README, Precision). A model loaded from safetensors is memory-mapped: a tensor's address modulo
64 is ``8 + header length + its data offset`` modulo 64. Saved shard by shard, unpadded, the
emitted model would not reproduce those addresses (Gemma 3 270M: 1.8e-4, not the in-memory
figure), so each shard's header is padded with spaces (which the format allows) by the shift
most of its patched weights need (:func:`shard_header`).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from ctxc.models.offload import pad_header, safetensors_header, store_file, stored_range

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "copy_range",
    "realign_shards",
    "shard_header",
    "source_alignments",
    "write_shards",
    "write_split",
]

_ALIGN = 64
_CHUNK = 16 << 20  # bytes copied or written at once
# torch dtype -> safetensors dtype (the format's names: safetensors docs, "Format").
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def source_alignments(model: torch.nn.Module, names) -> dict[str, int]:
    """Address modulo 64 of each named CPU or offloaded parameter as the solver read it."""
    out: dict[str, int] = {}
    for name in names:
        param = model.get_parameter(name)
        if param.device.type == "cpu":
            out[name] = param.data_ptr() % _ALIGN
            continue
        found = store_file(model, name)
        if found is not None:
            n, header = safetensors_header(found[0])
            out[name] = (8 + n + header[found[1]]["data_offsets"][0]) % _ALIGN
    return out


def copy_range(src: str, offset: int, count: int, dst: BinaryIO, chunk: int = _CHUNK) -> None:
    """Append bytes ``offset:offset + count`` of file ``src`` to ``dst``, ``chunk`` at a time.

    Raises:
        OSError: ``src`` ends before the range does.
    """
    buf = memoryview(bytearray(max(1, min(chunk, count))))
    with open(src, "rb", buffering=0) as f:
        f.seek(offset)
        left = count
        while left:
            n = f.readinto(buf[: min(len(buf), left)])
            if not n:
                raise OSError(f"{src} ends {left} bytes before the tensor it should hold")
            dst.write(buf[:n])
            left -= n


def shard_header(entries: list[tuple[str, str, list[int], int]], wanted: dict[str, int]) -> bytes:
    """A safetensors header (length prefix included) for tensors laid out in ``entries`` order.

    Args:
        entries: (name, safetensors dtype, shape, byte count) per tensor.
        wanted: parameter name -> the address modulo 64 it was solved at; the header is padded
            so that most of this shard's named tensors land there, else to 8 bytes.

    Returns:
        the bytes that precede the tensors' data.
    """
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, count in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + count]}
        offset += count
    raw = json.dumps(header, separators=(",", ":")).encode()
    pads = Counter(
        (wanted[name] - 8 - len(raw) - header[name]["data_offsets"][0]) % _ALIGN
        for name, *_ in entries
        if name in wanted
    )
    pad = pads.most_common(1)[0][0] if pads else -(8 + len(raw)) % 8
    return struct.pack("<Q", len(raw) + pad) + raw + b" " * pad


def saved_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor] | None:
    """What ``save_pretrained`` writes, by name (meta tensors where offloaded); None when the
    checkpoint's names or layout differ from the modules' (a weight conversion: MoE experts)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()  # views and meta tensors: nothing is read
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    reverted = revert_weight_conversion(model, dict(state))
    if reverted.keys() != state.keys() or any(reverted[k] is not v for k, v in state.items()):
        return None
    return state


def write_shards(
    model: PreTrainedModel, out: Path, max_shard_size: int, wanted: dict, workers: int = 1
) -> bool:
    """Write ``model``'s weights into ``out`` as ``save_pretrained`` shards them, chunk by chunk.

    Args:
        model: a dispersed model (its patched weights written where they live), or one in
            memory (its patched values swapped in by the caller).
        out: the model folder (exists; the config is written by the caller).
        max_shard_size: bytes per shard (a bigger tensor gets a shard of its own).
        wanted: parameter name -> address modulo 64 it was solved at (:func:`shard_header`).
        workers: threads writing a shard whose tensors are all in memory, each its own byte
            range (:func:`_write_parallel`).

    Returns:
        False, writing nothing, when the checkpoint layout differs from the modules' (the
        caller saves with ``save_pretrained``); True when written.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    state = saved_tensors(model)
    if state is None:
        return False
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        # safetensors' own order: wider dtypes first, then by name (keeps each tensor aligned)
        names = sorted(names, key=lambda k: (-state[k].element_size(), k))
        entries = [(k, _dtype(state[k]), list(state[k].shape), state[k].nbytes) for k in names]
        if workers > 1 and all(state[k].device.type == "cpu" for k in names):
            _write_parallel(out / filename, shard_header(entries, wanted), entries, state, workers)
            continue
        with open(out / filename, "wb") as f:
            f.write(shard_header(entries, wanted))
            for name, dtype, _, count in entries:
                _write_tensor(model, name, state[name], dtype, count, f)
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"  # as save_pretrained writes it
        (out / "model.safetensors.index.json").write_text(text, encoding="utf-8")
    return True


def write_split(model: PreTrainedModel, out: Path, patched, wanted: dict) -> bool:
    """Write ``model``'s weights into ``out`` as two shards: unpatched (linked) and patched.

    The unpatched tensors' shard is the cache entry of :mod:`ctxc.store.frozen_shards`, written
    once per model and hard-linked (a copy across file systems); the patched tensors' shard is
    written here by two threads, padded as :func:`shard_header` pads it. Each unpatched tensor
    is laid out at the address modulo 64 the model holds it at, as the patched ones are at the
    solver's. The index is the one ``save_pretrained`` writes for two shards.

    Args:
        model: a model in memory, its patched values swapped in by the caller.
        out: the model folder (exists; the config is written by the caller).
        patched: the names of the patched parameters.
        wanted: patched parameter name -> address modulo 64 it was solved at.

    Returns:
        False, writing nothing, when the split does not apply (a layout of its own, a tensor
        not in memory, nothing patched or nothing unpatched): the caller writes one file.
    """
    import hashlib

    from ctxc.models.fingerprint import fingerprint
    from ctxc.store.frozen_shards import link_or_copy, stored_entry

    state = saved_tensors(model)
    if state is None or any(v.device.type != "cpu" for v in state.values()):
        return False
    patched = set(patched)
    # safetensors' own order: wider dtypes first, then by name (keeps each tensor aligned)
    order = sorted(state, key=lambda k: (-state[k].element_size(), k))
    sides = ([k for k in order if k not in patched], [k for k in order if k in patched])
    if not all(sides):
        return False
    frozen, changed = (
        [(k, _dtype(state[k]), list(state[k].shape), state[k].nbytes) for k in names]
        for names in sides
    )
    held = {k: state[k].data_ptr() % _ALIGN for k, *_ in frozen}  # where the model reads them
    header = shard_header(frozen, held)
    prints = json.dumps(fingerprint(model), sort_keys=True).encode()
    key = hashlib.sha256(prints + header).hexdigest()[:40]
    size = len(header) + sum(count for *_, count in frozen)
    entry = stored_entry(key, size, lambda p: _write_parallel(p, header, frozen, state, 2))
    names = [f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
    link_or_copy(entry, out / names[0])
    _write_parallel(out / names[1], shard_header(changed, wanted), changed, state, 2)
    index = {
        "metadata": {
            "total_parameters": model.num_parameters(),
            "total_size": sum(v.nbytes for v in state.values()),
        },
        "weight_map": {k: names[0 if k not in patched else 1] for k in sorted(state)},
    }
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"  # as save_pretrained writes it
    (out / "model.safetensors.index.json").write_text(text, encoding="utf-8")
    return True


def _write_parallel(path: Path, header: bytes, entries: list, state: dict, workers: int) -> None:
    """Write one shard of in-memory tensors with ``workers`` threads, each its own byte range.

    The bytes are those the sequential path writes. Why threads: the page-cache copy of a
    write runs on the writing core (about 0.5 GB/s per writer on the 2-core machine of
    benchmarks/cost/cli.py, where Gemma 3 270M's 1 GB file took 1.6-2.5 s from one writer and
    0.5-1.4 s from two); ``os.pwrite`` releases the GIL.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    jobs, offset = [], len(header)
    for name, _, _, count in entries:
        value = state[name].detach().contiguous().reshape(-1)
        step = max(1, _CHUNK // value.element_size())
        jobs += [(value[i : i + step], offset + i * value.element_size())
                 for i in range(0, value.numel(), step)]  # fmt: skip
        offset += count
    total = sum(piece.nbytes for piece, _ in jobs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)

        def write(share: list) -> None:
            for piece, at in share:
                view = _bytes(piece)
                while len(view):
                    done = os.pwrite(fd, view, at)
                    view, at = view[done:], at + done

        # Contiguous shares of about equal bytes: each writer's pages stay together.
        shares: list[list] = []
        share: list = []
        filled = 0
        for job in jobs:
            share.append(job)
            filled += job[0].nbytes
            if filled >= total * (len(shares) + 1) / workers and len(shares) < workers - 1:
                shares.append(share)
                share = []
        shares.append(share)
        with ThreadPoolExecutor(len(shares)) as pool:
            list(pool.map(write, shares))
    finally:
        os.close(fd)


def _write_tensor(model, name: str, value: torch.Tensor, dtype: str, count: int, f) -> None:
    """Append tensor ``name``'s bytes to ``f``: copied from its file, or written by rows."""
    from ctxc.models.offload import read_param, read_rows

    offloaded = value.device.type == "meta"
    if offloaded:
        found = stored_range(model, name, dtype)
        if found is not None:
            copy_range(*found, f)
            return
    if value.dim() == 0:
        f.write(_bytes(read_param(model, name) if offloaded else value))
        return
    n = value.shape[0]
    step = max(1, _CHUNK // max(1, count // max(1, n)))  # rows per chunk
    for i in range(0, n, step):
        j = min(i + step, n)
        f.write(_bytes(read_rows(model, name, i, j) if offloaded else value[i:j]))


def _dtype(t: torch.Tensor) -> str:
    if t.dtype not in _DTYPES:
        raise ValueError(f"no safetensors dtype for {t.dtype}")
    return _DTYPES[t.dtype]


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (on the CPU, contiguous), without a copy when it is already so."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def realign_shards(folder: Path, wanted: dict[str, int]) -> int:
    """Pad the header of every shard in ``folder`` so its patched weights sit at ``wanted``.

    For a folder ``save_pretrained`` wrote (a model whose checkpoint layout differs from its
    modules', which :func:`write_shards` leaves to it).

    Args:
        folder: a saved model folder (``*.safetensors``).
        wanted: parameter name -> address modulo 64 it was solved at.

    Returns:
        the number of files rewritten. Side effect: those files are replaced.
    """
    rewritten = 0
    for path in sorted(folder.glob("*.safetensors")):
        n, header = safetensors_header(str(path))
        shifts = Counter(
            (wanted[k] - 8 - n - v["data_offsets"][0]) % _ALIGN
            for k, v in header.items()
            if k in wanted
        )
        if not shifts:
            continue
        pad = shifts.most_common(1)[0][0]
        if pad == 0:
            continue
        pad_header(str(path), pad)
        rewritten += 1
    return rewritten
