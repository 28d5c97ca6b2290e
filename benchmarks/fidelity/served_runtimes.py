"""The child process of ``benchmarks.fidelity.served_answers``: one runtime, greedy answers.

Run by path, never as a module of ctxc's, so that the runtime is all it imports (plain
Transformers, PEFT, onnxruntime, or llama.cpp through the wheel's cffi bindings; for llama.cpp,
ctxc's worker file is loaded by its path for its context settings, which imports no ctxc)::

    python benchmarks/fidelity/served_runtimes.py SPEC.json OUT.npz

``SPEC.json``: ``{"runtime": "transformers"|"peft"|"llama_cpp"|"ort", "threads": 1, "gen":
16, "stop": [ids], "base": PATH, "attach": {name: PATH}, "requests": [{"key": K, "on": name
or null, "ids": [...], "generate": bool}], "merge": bool}``. ``base`` is the base GGUF file
(Transformers' own GGUF loader, PEFT, llama.cpp) or the patchable ONNX (onnxruntime);
``worker`` (llama.cpp) the path of ``ctxc/backends/gguf/llama_cpp/worker.py``; ``attach`` the
models (Transformers: a folder), adapters (PEFT: a LoRA folder; llama.cpp:
``lora.gguf``; onnxruntime: ``.onnx_adapter``) a request can name in ``on`` (null: the base
alone). ``merge`` (PEFT, one adapter): the requests again after ``merge_and_unload()``, their
keys ``merged/...``.

Every request is answered greedily (``gen`` tokens at most, stopped after a token of ``stop``):
Transformers and PEFT continue their KV cache, llama.cpp decodes one token at a time on its
cache (``llama_batch_get_one``), onnxruntime runs the whole sequence each step (the patchable
graph has no cache inputs). ``OUT.npz`` holds each request's first-step logits (``first/K``);
the answers, each step's top two (id and logit), the seconds, the memory (``VmRSS``) after the
base and after the attachments, at the end and at its peak, and whether ``ctxc`` was imported
are printed as one JSON line.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np


def _rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (``VmHWM``: its peak), MiB (``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Torch:
    """Transformers or PEFT: the base from the GGUF file, models or adapters attached."""

    def __init__(self, spec: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(spec["threads"])
        self.torch = torch
        base = Path(spec["base"])
        self.base = AutoModelForCausalLM.from_pretrained(
            str(base.parent), gguf_file=base.name, dtype=torch.float32
        ).eval()
        self.rss_base = _rss_mb()
        self.peft = spec["runtime"] == "peft"
        self.models: dict = {}
        for i, (name, path) in enumerate(spec["attach"].items()):
            if not self.peft:
                self.models[name] = AutoModelForCausalLM.from_pretrained(path).eval()
            elif i == 0:
                from peft import PeftModel

                self.base = PeftModel.from_pretrained(self.base, path, adapter_name=name).eval()
            else:
                self.base.load_adapter(path, adapter_name=name)
        self.on: str | None = None

    def use(self, name: str | None) -> None:
        self.on = name
        if self.peft and name is not None:
            self.base.set_adapter(name)

    def _model(self):
        return self.models[self.on] if not self.peft and self.on else self.base

    def start(self, ids: list[int]) -> np.ndarray:
        with self.torch.no_grad(), self._adapter_off():
            out = self._model()(self.torch.tensor([ids]), use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def step(self, token: int) -> np.ndarray:
        with self.torch.no_grad(), self._adapter_off():
            out = self._model()(
                self.torch.tensor([[token]]), past_key_values=self.cache, use_cache=True
            )
        self.cache = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def _adapter_off(self):
        import contextlib

        if self.peft and self.on is None:
            return self.base.disable_adapter()
        return contextlib.nullcontext()

    def merge(self) -> None:
        self.base = self.base.merge_and_unload().eval()
        self.peft = False


class _LlamaCpp:
    """llama.cpp: the base GGUF, ``lora.gguf`` adapters loaded once, set per request."""

    def __init__(self, spec: dict) -> None:
        # ctxc's worker (numpy and the bindings only), loaded by its path: ctxc is not imported.
        loader = importlib.util.spec_from_file_location("served_llama_worker", spec["worker"])
        assert loader is not None and loader.loader is not None
        self.w = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(self.w)
        from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib

        self.lib, self.ffi = get_lib(), get_ffi()
        self.lib.llama_backend_init()
        self.model = self.w._load_model(self.lib, spec["base"])
        self.vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        longest = max(len(r["ids"]) for r in spec["requests"]) + spec["gen"]
        self.ctx = self.w._context(self.lib, self.model, longest, spec["threads"])
        self.rss_base = _rss_mb()
        self.adapters = {
            n: self.w._load_adapter(self.lib, self.model, p) for n, p in spec["attach"].items()
        }
        self.on: object = "unset"

    def use(self, name: str | None) -> None:
        if name != self.on:
            self.w._set_adapter(self.lib, self.ctx, None if name is None else self.adapters[name])
            self.on = name

    def _decode(self, ids: list[int]) -> np.ndarray:
        tokens = self.ffi.new("llama_token[]", ids)
        if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(tokens, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.frombuffer(self.ffi.buffer(ptr, 4 * self.vocab), dtype=np.float32).copy()

    def start(self, ids: list[int]) -> np.ndarray:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        return self._decode(ids)

    def step(self, token: int) -> np.ndarray:
        return self._decode([token])


class _Ort:
    """onnxruntime: the patchable ONNX, ``.onnx_adapter`` files active per run."""

    def __init__(self, spec: dict) -> None:
        import onnxruntime as ort

        self.ort = ort
        options = ort.SessionOptions()
        options.log_severity_level = 3  # else a warning per factor input (docs/backends.md)
        options.intra_op_num_threads = spec["threads"]
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(spec["base"], options)
        self.rss_base = _rss_mb()
        self.adapters = {}
        for name, path in spec["attach"].items():
            self.adapters[name] = ort.LoraAdapter()
            self.adapters[name].Load(path)
        self.options = ort.RunOptions()

    def use(self, name: str | None) -> None:
        self.options = self.ort.RunOptions()
        if name is not None:
            self.options.add_active_adapter(self.adapters[name])

    def start(self, ids: list[int]) -> np.ndarray:
        self.ids = list(ids)
        feed = {"input_ids": np.array([self.ids], np.int64)}
        return self.session.run(["logits"], feed, self.options)[0][0, -1]

    def step(self, token: int) -> np.ndarray:
        return self.start([*self.ids, token])


def _top2(row: np.ndarray) -> list:
    """``[id1, logit1, id2, logit2]``: the largest logit (the first on a tie, as argmax) and
    the runner-up."""
    first = int(np.argmax(row))
    rest = row.copy()
    rest[first] = -np.inf
    second = int(np.argmax(rest))
    return [first, float(row[first]), second, float(row[second])]


def answer(rt, ids: list[int], gen: int, stop: set[int], generate: bool) -> tuple:
    """Greedy tokens after ``ids`` (one step only unless ``generate``); the first step's logits
    and the request's record (tokens, top two per step, seconds)."""
    clock = time.perf_counter()
    row = rt.start(ids)
    first, prefill = row, time.perf_counter() - clock
    tokens, top2 = [], []
    for _ in range(gen if generate else 1):
        top2.append(_top2(row))
        tokens.append(top2[-1][0])
        if tokens[-1] in stop or len(tokens) == gen or not generate:
            break
        row = rt.step(tokens[-1])
    seconds = time.perf_counter() - clock
    return first, {"tokens": tokens, "top2": top2, "prefill_s": prefill, "seconds": seconds}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    clock = time.perf_counter()
    kind = spec["runtime"]
    rt = {"transformers": _Torch, "peft": _Torch, "llama_cpp": _LlamaCpp, "ort": _Ort}[kind](spec)
    load_s, rss_attached = time.perf_counter() - clock, _rss_mb()
    stop, firsts, records = set(spec["stop"]), {}, {}
    rounds = [""] + (["merged/"] if spec.get("merge") else [])
    for prefix in rounds:
        if prefix:
            rt.merge()
        for request in spec["requests"]:
            if prefix and request["on"] is None:
                continue  # merged: the adapter's requests only
            key = prefix + request["key"]
            rt.use(None if prefix else request["on"])
            firsts[f"first/{key}"], records[key] = answer(
                rt, request["ids"], spec["gen"], stop, request.get("generate", True)
            )
    np.savez(argv[1], **firsts)
    print(
        json.dumps(
            {
                "requests": records,
                "load_s": load_s,
                "rss_base_mb": rt.rss_base,
                "rss_attached_mb": rss_attached,
                "rss_end_mb": _rss_mb(),
                "peak_mb": _rss_mb("VmHWM"),
                "ctxc_imported": any(m == "ctxc" or m.startswith("ctxc.") for m in sys.modules),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
