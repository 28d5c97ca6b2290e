"""Which half of a baked patch reads and which harms: its linear deltas, its norm-scale deltas.

A fitted patch moves linear weights (LoRA-like factors) and post-norm scales (a vector per
norm); a server applies the first kind only (issue 54). For each of the no-harm benchmark's
first ``--paragraphs`` paragraphs (``benchmarks.thought.noharm``), the paragraph is baked with
``SETTING`` and the patched model is asked, with the whole patch, its linear deltas alone, its
vector deltas alone, and no patch: the paragraph's questions in ctxc's form (mean SQuAD F1),
the general questions (right), and another paragraph read with its questions (mean F1), as
that benchmark asks them; the original fed the paragraph gives the reading's and the general
questions' target.

    python -m benchmarks.thought.patch_parts [--paragraphs 3] [--setting default] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.thought.noharm import DATA, GENERAL, Framing, _f1, _other, right, setting_options
from benchmarks.thought.squad import answers
from testbed.tables import commit, invocation


def _asked(frame: Framing, model, para: dict, other: dict, general: list[dict], start, patch):
    """(reading F1 in ctxc's form, general questions right, another paragraph's F1) of the
    model with ``patch`` (None: as it is) fed ``start`` first."""
    tok, gen = frame.tok, frame.gen
    qs = frame.queries([q["question"] for q in para["questions"]], "ctxc")
    got = answers(model, tok, start, qs, patch=patch, gen=gen)["answers"]
    reading = sum(_f1(got, [q["answers"] for q in para["questions"]])[1]) / len(got)
    gq = frame.queries([g["q"] for g in general], "ctxc")
    said = answers(model, tok, start, gq, patch=patch, gen=gen)["answers"]
    right_count = sum(right(a, g["a"]) for a, g in zip(said, general, strict=True))
    alone, _, oq = frame.other(
        para["context"], other["context"], [q["question"] for q in other["questions"]]
    )
    read = answers(model, tok, alone, oq, patch=patch, gen=gen)["answers"]
    other_f1 = sum(_f1(read, [q["answers"] for q in other["questions"]])[1]) / len(read)
    return round(100 * reading, 1), right_count, round(100 * other_f1, 1)


def main(argv: list[str] | None = None) -> None:
    from ctxc.bake.driver import bake
    from ctxc.cli.support import load
    from ctxc.patch import Patch
    from ctxc.store.traced import traced_blocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paragraphs", type=int, default=3)
    p.add_argument("--setting", default="default", help="'default' or name=value,...")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the figures here (JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    general = json.loads(GENERAL.read_text())["questions"]
    subset = json.loads(DATA.read_text())["paragraphs"]
    model, tok = load(None, "float32")
    traced_blocks(model)
    frame = Framing(tok, False)
    rows = {}
    for para in subset[: args.paragraphs]:
        other = _other(subset, subset.index(para))
        full, none = frame.starts(para["context"])
        patch = bake(
            model, tok, options=setting_options(args.setting), **frame.bake_given(para["context"])
        ).patch
        linear = {k: d for k, d in patch.deltas.items() if d.vector is None}
        scale = {k: d for k, d in patch.deltas.items() if d.vector is not None}
        parts = {
            "patch": patch,
            "linear": Patch(linear, patch.meta),
            "scale": Patch(scale, patch.meta),
            "none": None,
        }
        row = {}
        for name, part in parts.items():
            row[name] = _asked(frame, model, para, other, general, none, part)
            print(para["id"], name, row[name], flush=True)
        row["full"] = _asked(frame, model, para, other, general, full, None)
        rows[para["id"]] = row
    pooled = {
        name: [round(sum(r[name][i] for r in rows.values()) / (1 if i == 1 else len(rows)), 1)
               for i in range(3)]
        for name in ("patch", "linear", "scale", "none", "full")
    }  # fmt: skip
    print("pooled (reading F1 mean, general right, other F1 mean):", pooled)
    if args.out:
        doc = {"setting": args.setting, "commit": commit(), "paragraphs": rows, "pooled": pooled}
        doc["command"] = invocation("benchmarks.thought.patch_parts")
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
