"""Run GGUF files in llama.cpp and save their logits: the child process of :mod:`llama_cpp_run`.

``python -m ctxc.backends.gguf.llama_cpp.worker JOBS.json OUT.npz`` reads a list of jobs, each
``{"model": path, "lora": path or null, "ids": [...], "k": n}``, runs ``ids`` through llama.cpp
(libllama of the PyPI wheel ``llama-cpp-py-sync``, through its cffi bindings) in one decode,
and saves the logits of the last ``k`` positions of job ``i`` as ``job{i}`` [k, vocab] float32.

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
from pathlib import Path

import numpy as np

__all__ = ["main", "run_jobs"]

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


def run_jobs(jobs: list[dict], threads: int) -> dict[str, np.ndarray]:
    """Run every job; ``{"job<i>": logits [k, vocab]}``. Models and adapters load once each.

    Raises:
        RuntimeError: a file llama.cpp cannot load, or a failed decode.
    """
    from llama_cpp_py_sync._cffi_bindings import get_lib

    lib, ffi = get_lib(), _ffi()
    lib.llama_backend_init()
    models: dict[str, object] = {}
    adapters: dict[tuple[str, str], object] = {}
    out = {}
    try:
        for i, job in enumerate(jobs):
            path = job["model"]
            if path not in models:
                params = lib.llama_model_default_params()
                params.n_gpu_layers = 0
                model = lib.llama_model_load_from_file(path.encode(), params)
                if model == ffi.NULL:
                    raise RuntimeError(f"llama.cpp cannot load {os.path.basename(path)}")
                models[path] = model
            model = models[path]
            vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
            ctx = _context(lib, model, len(job["ids"]), threads)
            try:
                if job.get("lora"):
                    key = (path, job["lora"])
                    if key not in adapters:
                        adapter = lib.llama_adapter_lora_init(model, job["lora"].encode())
                        if adapter == ffi.NULL:
                            raise RuntimeError(
                                f"llama.cpp cannot load the adapter {os.path.basename(key[1])}"
                            )
                        adapters[key] = adapter
                    handles = ffi.new("struct llama_adapter_lora *[1]", [adapters[key]])
                    scales = ffi.new("float[1]", [1.0])
                    if lib.llama_set_adapters_lora(ctx, handles, 1, scales) != 0:
                        raise RuntimeError("llama_set_adapters_lora failed")
                out[f"job{i}"] = _decode(lib, ctx, list(job["ids"]), int(job["k"]), vocab)
            finally:
                lib.llama_free(ctx)
    finally:
        for adapter in adapters.values():
            lib.llama_adapter_lora_free(adapter)
        for model in models.values():
            lib.llama_model_free(model)
    return out


def main(argv: list[str] | None = None) -> int:
    """``JOBS.json OUT.npz [THREADS]``: run the jobs, save the logits; 1 on a failure."""
    args = sys.argv[1:] if argv is None else argv
    jobs = json.loads(Path(args[0]).read_text())
    threads = int(args[2]) if len(args) > 2 else max(1, os.cpu_count() or 1)
    try:
        logits = run_jobs(jobs, threads)
    except RuntimeError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    # allow_pickle named (its default): a ** of arrays could otherwise bind it, says mypy.
    np.savez(args[1], allow_pickle=True, **logits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
