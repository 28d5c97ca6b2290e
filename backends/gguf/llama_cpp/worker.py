"""Run GGUF files in llama.cpp and save their logits: the child process of :mod:`llama_cpp_run`.

``python -m ctxc.backends.gguf.llama_cpp.worker JOBS.json OUT.npz`` reads a list of jobs, each
``{"model": path, "lora": path or null, "ids": [...], "k": n}``, runs ``ids`` through llama.cpp
(libllama of the PyPI wheel ``llama-cpp-py-sync``, through its cffi bindings) in one decode,
and saves the logits of the last ``k`` positions of job ``i`` as ``job{i}`` [k, vocab] float32.
A JSON object instead of a list is one model serving many adapters (:func:`run_switching`):
the requests' logits and the time each step took.

It runs in its own process on purpose: llama.cpp aborts the process on a failed assertion and
logs to stderr; a child keeps ctxc alive and its log is kept for the error message. It imports
numpy and the bindings only (no torch). The settings are the ones that make llama.cpp's run
comparable with Transformers' float32 one: F32 KV cache, no flash attention, no BOS added
(the ids are ctxc's, with whatever BOS the tokenizer put there), one batch for all ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "run_jobs", "run_switching"]

_GGML_TYPE_F32 = 0
_FLASH_ATTN_DISABLED = 0


def _context(lib, model, n: int, threads: int):
    """A fresh context for ``n`` tokens in one batch, F32 KV cache, flash attention off."""
    params = lib.llama_context_default_params()
    params.n_ctx = max(n, 8)
    params.n_batch = params.n_ctx
    params.n_ubatch = params.n_ctx
    params.n_seq_max = 1
    params.n_threads = threads
    params.n_threads_batch = threads
    params.type_k = _GGML_TYPE_F32
    params.type_v = _GGML_TYPE_F32
    params.flash_attn_type = _FLASH_ATTN_DISABLED
    params.no_perf = True
    ctx = lib.llama_init_from_model(model, params)
    if ctx == _ffi().NULL:
        raise RuntimeError(f"llama_init_from_model failed for {n} tokens")
    return ctx


def _ffi():
    from llama_cpp_py_sync._cffi_bindings import get_ffi

    return get_ffi()


def _decode(lib, ctx, ids: list[int], k: int, vocab: int) -> np.ndarray:
    """Decode ``ids`` in one batch; the logits of the last ``k`` positions [k, vocab]."""
    ffi = _ffi()
    batch = lib.llama_batch_init(len(ids), 0, 1)
    try:
        batch.n_tokens = len(ids)
        for i, token in enumerate(ids):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i >= len(ids) - k else 0
        code = lib.llama_decode(ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode failed with code {code}")
        rows = []
        for i in range(len(ids) - k, len(ids)):
            ptr = lib.llama_get_logits_ith(ctx, i)
            if ptr == ffi.NULL:
                raise RuntimeError(f"llama.cpp returned no logits at position {i}")
            rows.append(np.frombuffer(ffi.buffer(ptr, 4 * vocab), dtype=np.float32).copy())
        return np.stack(rows)
    finally:
        lib.llama_batch_free(batch)


def _load_model(lib, path: str):
    """Load a GGUF model on the CPU (no layer offloaded)."""
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(path.encode(), params)
    if model == _ffi().NULL:
        raise RuntimeError(f"llama.cpp cannot load {os.path.basename(path)}")
    return model


def _load_adapter(lib, model, path: str):
    """Load a LoRA GGUF onto ``model``."""
    adapter = lib.llama_adapter_lora_init(model, path.encode())
    if adapter == _ffi().NULL:
        raise RuntimeError(f"llama.cpp cannot load the adapter {os.path.basename(path)}")
    return adapter


def _set_adapter(lib, ctx, adapter) -> None:
    """Make ``adapter`` (scale 1) the context's only LoRA, or none when it is None."""
    ffi = _ffi()
    if adapter is None:
        if lib.llama_set_adapters_lora(ctx, ffi.NULL, 0, ffi.NULL) != 0:
            raise RuntimeError("llama_set_adapters_lora (none) failed")
        return
    handles = ffi.new("struct llama_adapter_lora *[1]", [adapter])
    scales = ffi.new("float[1]", [1.0])
    if lib.llama_set_adapters_lora(ctx, handles, 1, scales) != 0:
        raise RuntimeError("llama_set_adapters_lora failed")


def run_jobs(jobs: list[dict], threads: int) -> dict[str, np.ndarray]:
    """Run every job; ``{"job<i>": logits [k, vocab]}``. Models and adapters load once each.

    Raises:
        RuntimeError: a file llama.cpp cannot load, or a failed decode.
    """
    from llama_cpp_py_sync._cffi_bindings import get_lib

    lib = get_lib()
    lib.llama_backend_init()
    models: dict[str, object] = {}
    adapters: dict[tuple[str, str], object] = {}
    out = {}
    try:
        for i, job in enumerate(jobs):
            path = job["model"]
            if path not in models:
                models[path] = _load_model(lib, path)
            model = models[path]
            vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
            ctx = _context(lib, model, len(job["ids"]), threads)
            try:
                if job.get("lora"):
                    key = (path, job["lora"])
                    if key not in adapters:
                        adapters[key] = _load_adapter(lib, model, job["lora"])
                    _set_adapter(lib, ctx, adapters[key])
                out[f"job{i}"] = _decode(lib, ctx, list(job["ids"]), int(job["k"]), vocab)
            finally:
                lib.llama_free(ctx)
    finally:
        for adapter in adapters.values():
            lib.llama_adapter_lora_free(adapter)
        for model in models.values():
            lib.llama_model_free(model)
    return out


def _clear(lib, ctx) -> None:
    """Forget the context's KV cache, so the next decode starts at position 0."""
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)


def _serve(lib, model, adapters: list, spec: dict, threads: int) -> dict[str, np.ndarray]:
    """The requests of :func:`run_switching` on a loaded model and adapters; logits and timings."""
    requests, fresh = spec["requests"], bool(spec.get("fresh"))
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    n = len(requests)
    out: dict[str, np.ndarray] = {}
    timing = {key: np.zeros(n) for key in ("context_s", "set_s", "decode_s", "switched")}
    shared = None if fresh else _context(lib, model, max(len(r["ids"]) for r in requests), threads)
    current = None  # the shared context's adapter index (a fresh context has none)
    try:
        for i, request in enumerate(requests):
            clock = time.perf_counter()
            ctx = _context(lib, model, len(request["ids"]), threads) if fresh else shared
            if not fresh:
                _clear(lib, ctx)
            timing["context_s"][i] = time.perf_counter() - clock
            try:
                want = request.get("adapter")
                if want != (None if fresh else current):
                    clock = time.perf_counter()
                    _set_adapter(lib, ctx, None if want is None else adapters[want])
                    timing["set_s"][i] = time.perf_counter() - clock
                    timing["switched"][i], current = 1.0, want
                clock = time.perf_counter()
                logits = _decode(lib, ctx, list(request["ids"]), int(request["k"]), vocab)
                timing["decode_s"][i] = time.perf_counter() - clock
                out[f"job{i}"] = logits
            finally:
                if fresh:
                    lib.llama_free(ctx)
    finally:
        if shared is not None:
            lib.llama_free(shared)
    return {**out, **timing}


def run_switching(spec: dict, threads: int) -> dict[str, np.ndarray]:
    """One model, many adapters loaded once, requests that switch between them.

    ``spec``: ``{"model": path, "adapters": [path, ...], "requests": [{"adapter": index or
    None, "ids": [...], "k": n}, ...], "fresh": bool}``. With ``fresh`` false (a server's way)
    every request runs on one context, its KV cache cleared, and ``llama_set_adapters_lora`` is
    called when the request's adapter differs from the previous one's; with ``fresh`` true each
    request gets a new context (adapter set on it unless None) and frees it after.

    Returns:
        ``job<i>``: request ``i``'s logits [k, vocab]; ``load_s`` [adapters]: seconds to load
        each adapter; per request [requests]: ``context_s`` (creating, or clearing, its
        context), ``set_s`` (``llama_set_adapters_lora``; 0 when not called), ``decode_s``
        (the decode and the logits' copy), ``switched`` (1 where the adapter was set).

    Raises:
        RuntimeError: a file llama.cpp cannot load, a bad adapter index, or a failed decode.
    """
    from llama_cpp_py_sync._cffi_bindings import get_lib

    lib = get_lib()
    lib.llama_backend_init()
    model = _load_model(lib, spec["model"])
    adapters: list = []
    load_s = []
    try:
        for path in spec["adapters"]:
            clock = time.perf_counter()
            adapters.append(_load_adapter(lib, model, path))
            load_s.append(time.perf_counter() - clock)
        for request in spec["requests"]:
            a = request.get("adapter")
            if a is not None and not 0 <= a < len(adapters):
                raise RuntimeError(f"request names adapter {a}; {len(adapters)} are loaded")
        return {**_serve(lib, model, adapters, spec, threads), "load_s": np.array(load_s)}
    finally:
        for adapter in adapters:
            lib.llama_adapter_lora_free(adapter)
        lib.llama_model_free(model)


def main(argv: list[str] | None = None) -> int:
    """``JOBS.json OUT.npz [THREADS]``: run the jobs (a list, :func:`run_jobs`, or an object,
    :func:`run_switching`), save the logits (and timings); 1 on a failure."""
    args = sys.argv[1:] if argv is None else argv
    jobs = json.loads(Path(args[0]).read_text())
    threads = int(args[2]) if len(args) > 2 else max(1, os.cpu_count() or 1)
    try:
        # A list: independent jobs; an object: one model's requests switching adapters.
        logits = run_switching(jobs, threads) if isinstance(jobs, dict) else run_jobs(jobs, threads)
    except RuntimeError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    # allow_pickle named (its default): a ** of arrays could otherwise bind it, says mypy.
    np.savez(args[1], allow_pickle=True, **logits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
