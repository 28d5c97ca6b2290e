"""GGUF artefacts run in llama.cpp against llama.cpp's own full-context run (``ctxc[llamacpp]``).

When the PyPI wheel ``llama-cpp-py-sync`` (llama.cpp's prebuilt CPU libllama) loads, the GGUF
emitters run their artefact where its users serve it: ``model.gguf``, or ``lora.gguf`` on its
base, fed the query alone, against llama.cpp running the unpatched GGUF of the same type on
context + query. llama.cpp does not compute what Transformers computes (its GELU, its sums), so
the bound is relative to llama.cpp's own floor: the unpatched GGUF fed the query alone, llama.cpp
against Transformers. The artefact passes when its distance from llama.cpp's full-context run is
within :data:`LLAMA_CPP_FACTOR` times that floor (issue 21, check 2), plus the artefact's own
distance from the full-context run in Transformers (about 1e-5 for the exact rules; the ``lora``
rule's miss behind post norms on Gemma, which the Transformers check reports, is larger).

The floor is the larger of llama.cpp's distances from Transformers on the query alone and on
context + query: the reference itself is llama.cpp's full-context run, and on long contexts it
can be the further one (the bundled Gemma on examples/long.txt, 1075 tokens: 0.285 against 0.023
on the query alone; llama.cpp departs from position 839 on, where Transformers' SDPA, eager and
float64 runs agree within 2e-3, whatever its batch, window-cache or KV type settings).

The runs happen in a child process (:mod:`llama_cpp_worker`): llama.cpp aborts on a failed
assertion and logs to stderr, and neither may reach ctxc's process. :func:`llama_cpp_switching`
runs many adapters on one model the way a server does (issue 23, check 3: each loaded once,
``llama_set_adapters_lora`` per request), with the time of each step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ctxc.backends.gguf.thresholds import (
    LLAMA_CPP_FACTOR,
    LLAMA_CPP_MIN_FLOOR,
    LLAMA_CPP_PATCH_SHARE,
)
from ctxc.core.checks import enforce as enforce_bound
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word

__all__ = [
    "LLAMA_CPP_FACTOR",
    "LLAMA_CPP_MIN_FLOOR",
    "SHIM",
    "LlamaCppFigures",
    "LlamaCppSwitching",
    "llama_cpp_check",
    "llama_cpp_logits",
    "llama_cpp_switching",
    "llama_cpp_unavailable",
    "llama_cpp_version",
    "load_failure",
]


@functools.cache
def llama_cpp_unavailable() -> str | None:
    """Why llama.cpp cannot run here, or None when its library loads: one short line naming
    the cause and the fix (:func:`load_failure`), never the loader's whole message.

    Side effects: loads libllama into this process once (the check's runs use a child).
    """
    if importlib.util.find_spec("llama_cpp_py_sync") is None:
        return "llama-cpp-py-sync is not installed (pip install 'ctxc[llamacpp]')"
    try:
        from llama_cpp_py_sync._cffi_bindings import get_lib

        get_lib()
    except (OSError, RuntimeError, ImportError) as exc:
        return load_failure(str(exc) or type(exc).__name__)
    return None


# What a user runs after ``pip install 'ctxc[llamacpp]'`` on a glibc older than 2.38 (issue 34).
SHIM = "bash tools/llamacpp/install.sh .venv/bin/python (in a ctxc clone)"
_GLIBC = re.compile(r"version `GLIBC_([0-9.]+)' not found")


def load_failure(message: str, have: str | None = None) -> str:
    """The loader's error as one short line: a glibc too old for the prebuilt library names
    both versions and the shim; another error its first clause, at most 160 characters.

    Args:
        message: the loader's message (cffi's runs to ~400-700 characters).
        have: this system's glibc version (default: ``os.confstr``), for the tests.
    """
    found = _GLIBC.search(message)
    if found is not None:
        if have is None:
            have = (os.confstr("CS_GNU_LIBC_VERSION") or "glibc ?").split()[-1]
        return (
            f"llama.cpp's prebuilt library needs glibc >= {found.group(1)} and this system has "
            f"{have}: run {SHIM} to shim it, or use a newer system"
        )
    first = message.splitlines()[0].split("  Additionally,")[0].strip() if message else ""
    if len(first) > 160:
        first = first[:157] + "..."
    return f"llama.cpp's library does not load: {first}"


def llama_cpp_version() -> str:
    """``llama.cpp b11739``: the release the wheel's library was built from."""
    from llama_cpp_py_sync import __llama_cpp_tag__

    return f"llama.cpp {__llama_cpp_tag__}"


def _run_worker(spec: list | dict, what: str, threads: int | None) -> dict[str, np.ndarray]:
    """Run :mod:`llama_cpp_worker` on ``spec`` in a child process; the arrays it saved.

    Raises:
        CtxcError: the child fails (its last log line is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="ctxc-llama-") as tmp:
        path, result = Path(tmp) / "jobs.json", Path(tmp) / "logits.npz"
        path.write_text(json.dumps(spec))
        threads = max(1, torch.get_num_threads() if threads is None else threads)
        worker = [sys.executable, "-m", "ctxc.backends.gguf.llama_cpp.worker"]
        proc = subprocess.run(
            [*worker, str(path), str(result), str(threads)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            check=False,
        )
        if proc.returncode != 0 or not result.is_file():
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit status {proc.returncode}"
            raise CtxcError(f"{what}: llama.cpp could not run it: {last}")
        with np.load(result) as saved:
            return {key: saved[key].copy() for key in saved.files}


def llama_cpp_logits(
    jobs: list[dict], what: str, *, threads: int | None = None
) -> list[torch.Tensor]:
    """Run jobs in a llama.cpp child process (:mod:`llama_cpp_worker`); their logits.

    Args:
        jobs: each ``{"model": path, "lora": path or None, "ids": [...], "k": n}``.
        what: the artefact, for the error message.
        threads: llama.cpp's threads (default: torch's).

    Returns:
        float32 [k, vocab] per job, in order.

    Raises:
        CtxcError: the child fails (its last log line is in the message).
    """
    saved = _run_worker([{**j, "model": str(j["model"])} for j in jobs], what, threads)
    return [torch.from_numpy(saved[f"job{i}"]) for i in range(len(jobs))]


@dataclass(frozen=True)
class LlamaCppSwitching:
    """One llama.cpp model serving requests that switch between LoRA adapters.

    Attributes:
        logits: per request, float32 [k, vocab].
        load_s: seconds to load each adapter (``llama_adapter_lora_init``), once.
        context_s: per request, seconds to create its context (fresh) or clear the KV cache.
        set_s: per request, seconds of ``llama_set_adapters_lora`` (0 where not called).
        decode_s: per request, seconds of the decode (and the logits' copy).
        switched: per request, whether its adapter was set (it differed from the last one).
        fresh: a new context per request (else one context for all).
    """

    logits: tuple[torch.Tensor, ...]
    load_s: tuple[float, ...]
    context_s: tuple[float, ...]
    set_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    switched: tuple[bool, ...]
    fresh: bool


def llama_cpp_switching(
    model: Path,
    adapters: list[Path],
    requests: list[tuple[int | None, list[int], int]],
    *,
    what: str = "lora.gguf",
    fresh: bool = False,
    threads: int | None = None,
) -> LlamaCppSwitching:
    """Load ``model`` and every adapter once in a llama.cpp child; run the requests in turn.

    Args:
        model: the base GGUF.
        adapters: LoRA GGUFs for ``model``.
        requests: ``(adapter index or None, ids, k)``: the logits of the last ``k`` ids.
        what: the artefacts, for the error message.
        fresh: a new context per request, else one context whose adapter is switched.
        threads: llama.cpp's threads (default: torch's).

    Returns:
        the :class:`LlamaCppSwitching`.

    Raises:
        CtxcError: the child fails (a file it cannot load, a bad index, a failed decode).
    """
    spec = {
        "model": str(model),
        "adapters": [str(a) for a in adapters],
        "requests": [{"adapter": a, "ids": list(ids), "k": k} for a, ids, k in requests],
        "fresh": fresh,
    }
    saved = _run_worker(spec, what, threads)

    def floats(key: str) -> tuple[float, ...]:
        return tuple(float(x) for x in saved[key])

    return LlamaCppSwitching(
        logits=tuple(torch.from_numpy(saved[f"job{i}"]) for i in range(len(requests))),
        load_s=floats("load_s"),
        context_s=floats("context_s"),
        set_s=floats("set_s"),
        decode_s=floats("decode_s"),
        switched=tuple(bool(x) for x in saved["switched"]),
        fresh=fresh,
    )


@dataclass(frozen=True)
class LlamaCppFigures:
    """A GGUF artefact run in llama.cpp, fed the query alone.

    Attributes:
        runtime: ``llama.cpp b11739`` (the wheel's library, CPU, F32 KV cache).
        reference: what ``patched`` and ``control`` are measured against: llama.cpp on the
            unpatched GGUF of the same type, fed context + query.
        base: the unpatched GGUF (``F32 GGUF written for the check``, or the source file).
        patched: the artefact fed the query, against the reference.
        control: the unpatched GGUF fed the query, against the reference.
        floor: ``max |logits|`` of llama.cpp from Transformers, unpatched, query alone.
        full_vs_transformers: the same on context + query (the reference against Transformers').
        own: the artefact's distance from the full-context run in Transformers (max |diff|).
        tolerance: ``LLAMA_CPP_FACTOR * max(floor, full_vs_transformers, LLAMA_CPP_MIN_FLOOR)
            + own``, the bound ``patched`` met; None: reported only.
        seconds: wall time of the writing and the runs.
        vs_patched: the artefact fed the query against ctxc's patched model in Transformers (the
            same query): what a served adapter must reproduce, or None where not given.
        patch_effect: max |diff| of that patched model from the unpatched one, query alone.
        patched_tolerance: ``LLAMA_CPP_FACTOR * max(...) + LLAMA_CPP_PATCH_SHARE *
            patch_effect``, the bound ``vs_patched`` met (an adapter that changes nothing is
            ``patch_effect`` away); None: reported only.
    """

    runtime: str
    reference: str
    base: str
    patched: Fidelity
    control: Fidelity
    floor: float
    full_vs_transformers: float
    own: float
    tolerance: float | None
    seconds: float
    vs_patched: Fidelity | None = None
    patch_effect: float | None = None
    patched_tolerance: float | None = None

    def to_dict(self) -> dict:
        """The JSON form (under ``llama_cpp`` of the GGUF backends' figures)."""
        return asdict(self)

    def summary(self) -> str:
        """A clause for the terminal line."""
        p = self.patched
        bound = "" if self.tolerance is None else f" (bound {self.tolerance:.3g})"
        line = (
            f"in {self.runtime} on {self.base} vs its full-context run max "
            f"{p.max_abs_logit_diff:.3g}{bound}, top-1 {top1_word(p.top1_match)}"
        )
        if self.vs_patched is not None:
            line += f"; vs ctxc's patched model max {self.vs_patched.max_abs_logit_diff:.3g}"
        return line


def _share_note(share: float, effect: float | None) -> str:
    """The bound's baked-patch term, for the message ('' when none)."""
    if not share or effect is None:
        return ""
    return f" plus {LLAMA_CPP_PATCH_SHARE:g} of the patch's effect ({effect:.3g})"


def llama_cpp_check(
    what: str,
    base: Path,
    *,
    patched: Path | None = None,
    lora: Path | None = None,
    ids: tuple[list[int], list[int]],
    transformers_query: torch.Tensor,
    transformers_full: torch.Tensor,
    base_name: str,
    own: float = 0.0,
    enforce: bool = True,
    transformers_patched: torch.Tensor | None = None,
    baked: bool = False,
) -> LlamaCppFigures:
    """Run the artefact and the unpatched ``base`` in llama.cpp; check the bound.

    Args:
        what: the artefact's file name, for messages (``model.gguf``, ``lora.gguf``).
        base: the unpatched GGUF (the reference runs on it).
        patched: the patched GGUF (``model.gguf``), or None with ``lora``.
        lora: a LoRA GGUF applied on ``base``, or None with ``patched``.
        ids: ``(context ids, query ids)``.
        transformers_query: the unpatched torch model fed the query alone [k, vocab].
        transformers_full: the unpatched torch model fed context + query, query rows [k, vocab].
        base_name: how the report names ``base``.
        own: the artefact's own distance from the full-context run in Transformers, added to
            the bound (a rule that is not exact cannot be closer in llama.cpp).
        enforce: raise when the bound fails (else the figures are reported only).
        transformers_patched: ctxc's patched model fed the query, in Transformers [k, vocab]:
            the artefact is also held to it (``LLAMA_CPP_PATCH_SHARE``), so that one which
            changes nothing fails whatever the patch's distance from the full context.
        baked: the patch is fitted (``ctxc bake``): with ``transformers_patched``, the bound
            from the full-context run also takes that share of the patch's effect (the
            triangle through ctxc's patched model: its own distance, then the artefact's);
            an exact compile's stays its floor plus its own distance.

    Returns:
        the :class:`LlamaCppFigures`.

    Raises:
        CtxcError: llama.cpp cannot run a file, or (``enforce``) the artefact is further from
            llama.cpp's full-context run than the bound.
    """
    clock = time.perf_counter()
    context, query = ids
    k = len(query)
    jobs: list[dict] = [
        {"model": base, "lora": None, "ids": context + query, "k": k},
        {"model": base, "lora": None, "ids": query, "k": k},
        {
            "model": patched or base,
            "lora": None if lora is None else str(lora),
            "ids": query,
            "k": k,
        },
    ]
    full, alone, got = llama_cpp_logits(jobs, what)
    floor = float((alone - transformers_query).abs().max())
    full_floor = float((full - transformers_full).abs().max())
    scale = max(floor, full_floor, LLAMA_CPP_MIN_FLOOR)
    runtime = llama_cpp_version()
    effect = None
    if transformers_patched is not None:
        effect = float((transformers_patched - transformers_query).abs().max())
    share = LLAMA_CPP_PATCH_SHARE * effect if baked and effect is not None else 0.0
    figures = LlamaCppFigures(
        runtime=runtime,
        reference=f"{runtime}, unpatched GGUF, context+query",
        base=base_name,
        patched=fidelity(got, full),
        control=fidelity(alone, full),
        floor=floor,
        full_vs_transformers=full_floor,
        own=own,
        tolerance=LLAMA_CPP_FACTOR * scale + own + share if enforce else None,
        seconds=round(time.perf_counter() - clock, 3),
    )
    if transformers_patched is not None and effect is not None:  # effect: set with it
        bound = LLAMA_CPP_FACTOR * scale + LLAMA_CPP_PATCH_SHARE * effect
        figures = dataclasses.replace(
            figures,
            vs_patched=fidelity(got, transformers_patched),
            patch_effect=effect,
            patched_tolerance=bound if enforce else None,
        )
    worst = figures.patched.max_abs_logit_diff
    if figures.tolerance is not None:  # NaN fails too (ctxc.core.checks.enforce)
        enforce_bound(
            what,
            f"in {runtime}, fed the query, vs llama.cpp's full-context run on {base_name}: "
            "max |diff|",
            worst,
            figures.tolerance,
            f"mean {figures.patched.mean_abs_logit_diff:.3g}; bound {LLAMA_CPP_FACTOR:g}x "
            f"llama.cpp's own distance from Transformers ({scale:.3g}) plus the artefact's own "
            f"({own:.3g}){_share_note(share, effect)}",
        )
    if figures.vs_patched is not None and figures.patched_tolerance is not None:
        enforce_bound(
            what,
            f"in {runtime}, fed the query, vs ctxc's patched model in Transformers: max |diff|",
            figures.vs_patched.max_abs_logit_diff,
            figures.patched_tolerance,
            f"mean {figures.vs_patched.mean_abs_logit_diff:.3g}; bound {LLAMA_CPP_FACTOR:g}x "
            f"llama.cpp's own distance from Transformers ({scale:.3g}) plus "
            f"{LLAMA_CPP_PATCH_SHARE:g} of the patch's effect ({figures.patch_effect:.3g})",
        )
    return figures
