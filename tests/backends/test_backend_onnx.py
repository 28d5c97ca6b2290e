"""The ONNX backends: baked weights and the patchable export, each checked by onnxruntime.

Tolerances are about ten times what is measured (torch 2.13, onnxruntime 1.23, 2 CPU cores):
onnxruntime against the torch patched model, max |logit diff| over the check inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
import transformers as tf

import ctxc
from ctxc.backends.onnx.check import ONNX_ATOL, check_lengths
from ctxc.backends.onnx.export import reusable_export
from ctxc.backends.onnx.model import ONNX_FILE, emit_onnx
from ctxc.backends.onnx.ort_adapter import ADAPTER_FILE, PATCHABLE_FILE
from ctxc.backends.onnx.patchable import emit_onnx_patchable, patch_feeds
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import MOE, build, shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import (
    NOISE,
    TRAIL_LINE,
    diff_msg,
    full_logits,
    logits,
    max_diff,
    random_ids,
    run_cli,
)

if TYPE_CHECKING:
    import onnxruntime as ort

# family -> bound on max |onnxruntime - torch patched|, about ten times the measured figure (in
# the comment; the largest over the query and two other lengths).
BAKED_ATOL = {
    "llama": 1.5e-6,  # 1.2e-7
    "gpt2": 7e-6,  # 7.2e-7 (Conv1D, layout in_out)
    "gemma3": 7e-6,  # 7.2e-7 (post-norm scales)
    "mixtral": 1e-6,  # 1.0e-7 (expert banks)
}
# family -> bound on max |onnxruntime on the query - unpatched torch on context + query|: the
# above plus the compile's own error (torch patched vs full context: 4.5e-8 to 7.5e-8 for the
# Llama patches here, 6e-8 for Mixtral, 1.2e-7 for the CLI's Gemma 3).
FULL_CONTEXT_ATOL = {"llama": 2e-6, "mixtral": 2e-6, "gemma3": 1e-5}


def _session(path: Path) -> ort.InferenceSession:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, ids: list[int], feeds: dict | None = None) -> np.ndarray:
    out = session.run(["logits"], {**(feeds or {}), "input_ids": np.array([ids], np.int64)})
    return out[0][0]  # [n, vocab]


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int, bytes]]:
    """Every parameter and buffer: the tensor object, its data pointer, its bytes."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: (t, t.data_ptr(), t.detach().cpu().numpy().tobytes()) for n, t in tensors.items()}


def _assert_untouched(model: torch.nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys(), "the export added or removed model tensors"
    moved = [n for n, (t, ptr, _) in before.items() if after[n][0] is not t or after[n][1] != ptr]
    assert not moved, f"the export replaced model tensors: {moved[:3]}"
    changed = [n for n, (_, _, data) in before.items() if after[n][2] != data]
    assert not changed, f"the export wrote into model tensors: {changed[:3]}"


def _assert_matches_patched(model, patch, path, figures, atol: float) -> None:
    """onnxruntime on ``path`` vs the torch model with ``patch.apply``, at three lengths."""
    session = _session(path)
    worst = 0.0
    for ids in (patch.meta.query_ids, random_ids(7, 3), random_ids(8, 11)):
        got, want = _run(session, ids), logits(model, ids, patch)
        worst = max(worst, max_diff(got, want))
        assert max_diff(got, want) <= atol, diff_msg(
            f"onnxruntime vs torch patched, {len(ids)} tokens", got, want
        )
    for check in figures.checks:
        assert check.max_abs_diff <= atol and check.top1_match, check
        assert check.max_rel_diff == pytest.approx(check.max_abs_diff / check.max_abs_logit)
    print(f"max |onnxruntime - torch patched| {worst:.3g}")


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama and two contexts' patches: a one-token query (rank 1), a two-token (rank 2).

    The models here are the session's ``shared`` ones (seed 0, as ``build``; built and traced
    once): every export and check leaves the model as it was (``_assert_untouched``)."""
    model = shared("llama")
    a = random_ids(1, 24)
    b = random_ids(2, 17)
    patch_a = ctxc.compile(model, context_ids=a).patch
    patch_b = ctxc.compile(model, context_ids=b[:-2], query_ids=b[-2:]).patch
    return model, patch_a, patch_b


@pytest.fixture(scope="module")
def baked(llama, tmp_path_factory):
    model, patch, _ = llama
    before = _snapshot(model)
    out = tmp_path_factory.mktemp("baked")
    path, figures = emit_onnx(model, patch, out, external_data=True)
    return path, figures, before


@pytest.mark.tiny
def test_cli_rejects_patchable_without_onnx(tmp_path) -> None:
    """In this process (``run_cli``): a usage error, refused before anything is imported."""
    args = ["export", "--patch", "p.safetensors", "--to", "torch", "--patchable"]
    proc = run_cli(*args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert not (tmp_path / "out").exists()
    assert "--patchable applies to --to onnx" in lines[0]


@pytest.mark.tiny
def test_the_compiles_export_serves_the_baked_route_while_the_model_holds_its_tensors(llama):
    """The baked route reuses the process's export of a compiled model (the same graph: the
    files above are byte-identical either way), never one whose tensors were replaced since."""
    model = llama[0]
    traced, _ = traced_blocks(model)
    assert reusable_export(model) is traced.program
    mlp = model.get_submodule("model.layers.0.mlp.down_proj")
    old = mlp.weight
    mlp.weight = torch.nn.Parameter(old.detach().clone())
    try:
        assert reusable_export(model) is None, "a graph reading a replaced tensor was reused"
    finally:
        mlp.weight = old
    assert reusable_export(model) is traced.program


@pytest.mark.slow
@needs_extra("onnx")
def test_baked_onnx_runs_in_plain_onnxruntime_at_any_length(llama, baked) -> None:
    model, patch, _ = llama
    path, figures, before = baked
    _assert_untouched(model, before)  # first: the checks below apply the patch themselves
    assert path.name == ONNX_FILE and (path.parent / f"{ONNX_FILE}.data").is_file()
    assert figures.external_data and not figures.patchable and figures.patch_inputs == 0
    assert figures.opset >= 17 and figures.experts == "dense"
    assert figures.deltas_inserted == len(patch.deltas) > 0
    assert [c.length for c in figures.checks] == [1, 16]
    assert figures.tolerance == ONNX_ATOL

    session = _session(path)
    [ids] = session.get_inputs()
    assert (ids.name, ids.type, ids.shape[0]) == ("input_ids", "tensor(int64)", 1)
    assert isinstance(ids.shape[1], str), f"sequence length fixed at export: {ids.shape}"
    assert [o.name for o in session.get_outputs()] == ["logits"]
    query = patch.meta.query_ids
    full = full_logits(model, patch)
    got = _run(session, query)
    tol = FULL_CONTEXT_ATOL["llama"]
    assert max_diff(got, full) <= tol, diff_msg("onnxruntime vs full context", got, full)
    assert abs(figures.fidelity.max_abs_logit_diff - max_diff(got, full)) <= 1e-7
    _assert_matches_patched(model, patch, path, figures, BAKED_ATOL["llama"])


@pytest.mark.slow
@needs_extra("onnx")
def test_baked_onnx_is_the_same_file_twice(llama, baked, tmp_path) -> None:
    model, patch, _ = llama
    first, _, _ = baked
    second, _ = emit_onnx(model, patch, tmp_path, external_data=True)
    for name in (ONNX_FILE, f"{ONNX_FILE}.data"):
        a, b = (first.parent / name).read_bytes(), (second.parent / name).read_bytes()
        assert a == b, f"{name} differs between two exports ({len(a)} vs {len(b)} bytes)"


@pytest.mark.slow
@needs_extra("onnx")
@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_baked_onnx_of_each_shape_matches_torch_patched(family: str, tmp_path) -> None:
    """Conv1D (in_out), MoE expert banks: baked, untouched model. Post-norm scales (Gemma 3):
    the CLI test below, against the full context; every family's figures:
    ``python -m benchmarks.fidelity.onnx`` (docs/results/fidelity-onnx.md)."""
    model = shared(family)
    patch = ctxc.compile(model, context_ids=random_ids(3, 20)).patch
    if family in MOE:
        assert any(d.experts for d in patch.deltas.values()), "no expert-bank delta to test"
        # The model's own default: its grouped_mm custom op does not export.
        model.set_experts_implementation("grouped_mm")
    try:
        before = _snapshot(model)
        path, figures = emit_onnx(model, patch, tmp_path)
        _assert_untouched(model, before)
        assert figures.deltas_inserted == len(patch.deltas)
        if family in MOE:
            assert figures.experts.startswith("batched_mm"), figures.experts
            implementation = model.config._experts_implementation
            assert implementation == "grouped_mm", "implementation not restored"
    finally:
        if family in MOE:  # the shared model's own (build_any's); the reference runs it too
            model.set_experts_implementation("batched_mm")
    _assert_matches_patched(model, patch, path, figures, BAKED_ATOL[family])


@pytest.mark.slow
@needs_extra("onnx")
def test_a_failed_check_is_one_line_error(llama, baked) -> None:
    model, patch, _ = llama
    path, _, _ = baked
    session = _session(path)
    x = torch.tensor([patch.meta.query_ids])
    unpatched = logits(model, patch.meta.query_ids)

    def run(ids: np.ndarray) -> np.ndarray:
        return session.run(["logits"], {"input_ids": ids})[0]

    with pytest.raises(ctxc.CtxcError) as info:
        check_lengths(run, [x], [unpatched], atol=1e-6)
    assert str(info.value).startswith("model.onnx check failed: onnxruntime vs the torch patched")
    assert "\n" not in str(info.value)

    def fixed_length(ids: np.ndarray) -> np.ndarray:
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions")

    with pytest.raises(ctxc.CtxcError, match="could not run the export at 1 tokens"):
        check_lengths(fixed_length, [x], [unpatched])


@pytest.mark.slow
@needs_extra("onnx")
def test_patchable_onnx_takes_any_contexts_patch(llama, tmp_path) -> None:
    model, patch_a, patch_b = llama
    assert {d.rank for d in patch_a.deltas.values()} == {1}
    assert {d.rank for d in patch_b.deltas.values()} == {2}
    path, figures = emit_onnx_patchable(model, patch_a, tmp_path)
    assert figures.patchable and figures.patch_inputs == 2 * len(patch_a.deltas)
    assert figures.runtime_floor is not None and figures.runtime_floor <= 1e-5, figures
    session = _session(path)
    # The factor inputs have zero defaults (overridable initializers): optional inputs.
    assert [i.name for i in session.get_inputs()] == ["input_ids"]
    names = ["input_ids", *(i.name for i in session.get_overridable_initializers())]
    first = next(iter(patch_a.deltas))
    assert names[:3] == ["input_ids", f"{first}::u", f"{first}::v"]

    # Two contexts' patches, the second of another rank, through the same file.
    for what, patch in (("context A", patch_a), ("context B", patch_b)):
        got = _run(session, patch.meta.query_ids, patch_feeds(patch, session))
        full = full_logits(model, patch)
        tol = FULL_CONTEXT_ATOL["llama"]
        assert max_diff(got, full) <= tol, diff_msg(
            f"{what}: patchable ONNX vs full context", got, full
        )

    # The feeds of a saved patch are those of the patch, and an all-zero feed is the base model.
    saved = patch_b.save(tmp_path / "patch.safetensors")
    from_file = patch_feeds(saved, path)
    for name, array in patch_feeds(patch_b, path).items():
        assert np.array_equal(array, from_file[name]), name
    zeros = {k: np.zeros_like(v[:, :1] if v.ndim == 2 else v) for k, v in from_file.items()}
    x = random_ids(8, 6)
    got, want = _run(session, x, zeros), logits(model, x)
    tol = BAKED_ATOL["llama"]
    assert max_diff(got, want) <= tol, diff_msg("zero patch vs unpatched model", got, want)

    # A patch of fewer blocks fits: the blocks it leaves alone are fed zero deltas.
    ids = random_ids(9, 20)
    later = ctxc.compile(model, context_ids=ids, start_layer=1).patch
    feeds = patch_feeds(later, session)
    assert len(feeds) == len(names) - 1
    got = _run(session, later.meta.query_ids, feeds)
    full = full_logits(model, later)
    tol = FULL_CONTEXT_ATOL["llama"]
    assert max_diff(got, full) <= tol, diff_msg("start-layer-1 patch vs full context", got, full)

    other = build("llama", seed=1)
    alien = ctxc.compile(other, context_ids=ids).patch
    with pytest.raises(ctxc.CtxcError, match="another model"):
        patch_feeds(alien, session)


@pytest.mark.slow
@needs_extra("onnx")
def test_patchable_moe_takes_other_experts_patches(tmp_path) -> None:
    model = shared("mixtral")
    a = ctxc.compile(model, context_ids=random_ids(4, 20)).patch
    b = ctxc.compile(model, context_ids=random_ids(5, 13)).patch
    banks_a = {n: d.experts for n, d in a.deltas.items() if d.experts}
    banks_b = {n: d.experts for n, d in b.deltas.items() if d.experts}
    assert banks_a and banks_a != banks_b, "the test needs contexts that change other experts"
    before = _snapshot(model)
    path, figures = emit_onnx_patchable(model, a, tmp_path / "patchable")
    _assert_untouched(model, before)
    assert figures.patchable and figures.experts == "batched_mm"
    session = _session(path)
    listed = [*session.get_inputs(), *session.get_overridable_initializers()]
    shapes = {i.name: i.shape for i in listed}
    first = next(iter(banks_a))
    assert shapes[f"{first}::u"][0] == model.get_parameter(first).shape[0], "not the whole bank"
    got = _run(session, b.meta.query_ids, patch_feeds(b, session))
    full = full_logits(model, b)
    tol = FULL_CONTEXT_ATOL["mixtral"]
    assert max_diff(got, full) <= tol, diff_msg("other experts' patch, patchable ONNX", got, full)


@pytest.mark.slow
@needs_extra("onnx", "peft")
def test_cli_compile_emits_checked_onnx_and_peft_and_exports_patchable(tiny_model_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    context = tmp_path / "context.txt"
    context.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    out = tmp_path / "out"

    def cli(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ctxc.cli.app", *args, "--model", str(tiny_model_dir)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)

    # The three ONNX-side artefacts in one compile (the ORT adapter's CLI path too).
    emit = "onnx,peft,ort-adapter"
    proc = cli("compile", "--context", str(context), "--out", str(out), "--emit", emit)
    assert proc.returncode == 0, proc.stderr
    # Into a log (stderr no terminal): the progress trail alone, no third-party lines (torch.onnx
    # warnings, onnxruntime, bars); -v below lets them through, so this can fail.
    odd = [line for line in proc.stderr.splitlines() if not TRAIL_LINE.fullmatch(line)]
    assert not odd, f"stderr holds more than the progress trail: {odd[:5]}"
    assert "ctxc: exporting model.onnx and checking it with onnxruntime" in proc.stderr
    adapter = [ADAPTER_FILE, f"{ADAPTER_FILE}.json", PATCHABLE_FILE]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".ctxc", "adapter", "model.onnx", "patch.safetensors", "report.json", *adapter]
    )
    report = json.loads((out / "report.json").read_text())
    assert report["onnx"]["opset"] >= 17 and report["onnx"]["experts"] == "dense"
    assert len(report["onnx"]["checks"]) == 2
    assert report["peft"]["modules_to_save"], "Gemma 3's post-norm scales need modules_to_save"
    fid = report["ort-adapter"]["fidelity"]
    assert fid["max_abs_logit_diff"] <= 1e-5 and fid["top1_match"], fid

    base = tf.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    base.eval()
    query, full_ids = report["query_ids"], report["context_ids"] + report["query_ids"]
    full = logits(base, full_ids)[-1:]
    got = _run(_session(out / "model.onnx"), query)
    tol = FULL_CONTEXT_ATOL["gemma3"]
    assert max_diff(got, full) <= tol, diff_msg("CLI model.onnx vs full context", got, full)
    assert abs(report["onnx"]["fidelity"]["max_abs_logit_diff"] - max_diff(got, full)) <= 1e-7

    exported = tmp_path / "exported"
    proc = cli(
        "export",
        "--patch",
        str(out / "patch.safetensors"),
        "--to",
        "onnx",
        "--patchable",
        "--out",
        str(exported),
        "-v",
    )
    assert proc.returncode == 0, proc.stderr
    noise = [line for line in proc.stderr.splitlines() if NOISE.search(line)]
    assert any("torchvision" in line for line in noise), proc.stderr[-2000:]
    assert json.loads((exported / "report.json").read_text())["onnx"]["patchable"] is True
    path = exported / "model.onnx"
    got = _run(_session(path), query, patch_feeds(out / "patch.safetensors", path))
    assert max_diff(got, full) <= tol, diff_msg("patchable export vs full context", got, full)
