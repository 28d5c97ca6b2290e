"""The export ladder (compiler/frontend/ladder.py): a model whose dynamic export fails falls back
to a bounded range, to static exports per length, or to a specialised export, and says which rung
it used; every rung failing names each one's reason."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim, export

from ctxc.core.errors import CtxcError
from ctxc.frontend.ladder import build_frontend, suggested_range
from ctxc.frontend.trace import LogitsOnly
from testbed.coverage import run_entry as coverage
from testbed.coverage.entries import entries

# Measured: 1.8e-7 (gpt_neo), 2.4e-7 (llama4_text), 2.7e-7 (mpt); the tolerance is the matrix's.
FRONTEND = {"gpt_neo": "bounded", "mpt": "bounded", "llama4_text": "static"}


def _fig(rec: dict) -> str:
    if "max_abs_logit_diff" not in rec:
        return str(rec)
    return (
        f"{rec['family']}: {rec['status']}, emitted max {rec['max_abs_logit_diff']:.3g}, "
        f"control max {rec['control_max_abs_logit_diff']:.3g}, frontend {rec.get('frontend')}"
    )


@pytest.mark.tiny
@pytest.mark.parametrize("family", sorted(FRONTEND))
def test_export_ladder_rung(family: str) -> None:
    rec = coverage.run_entry(next(e for e in entries({family}) if not e.scope))
    assert rec["status"] == "exact", _fig(rec)
    assert rec["max_abs_logit_diff"] <= coverage.TOL, _fig(rec)
    assert rec["control_max_abs_logit_diff"] > 1e-2, _fig(rec)
    assert rec["frontend"] == FRONTEND[family], _fig(rec)


def test_suggested_range_is_parsed() -> None:
    err = RuntimeError("Constraints violated (seq)!\nSuggested fixes:\n  seq = Dim('seq', max=256)")
    assert suggested_range(err, (1, 2048)) == (1, 256)
    err = RuntimeError("Suggested fixes:\n  seq = Dim('seq', min=2, max=255)")
    assert suggested_range(err, (1, 2048)) == (2, 255)
    assert suggested_range(RuntimeError("Suggested fixes:\n  seq = 8"), (1, 2048)) is None
    assert suggested_range(RuntimeError("no suggestion"), (1, 2048)) is None


class _Unexportable(torch.nn.Module):
    """A model no rung can export: it refuses to be traced at all."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids):
        if torch.compiler.is_exporting():
            raise RuntimeError("this model refuses export")
        return self.emb(input_ids)


@pytest.mark.tiny
def test_every_rung_failing_names_each_reason() -> None:
    model = _Unexportable().eval()
    with pytest.raises(CtxcError) as info:
        build_frontend(model, lambda traced: None)
    msg = str(info.value)
    assert "every export rung failed" in msg and "dynamic [1," in msg and "static (8" in msg, msg


class _ExpertLoop(torch.nn.Module):
    """An eager expert loop: which "experts" run, and on which rows, depends on the ids' values."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids):
        x = self.emb(input_ids)[0]
        mask = torch.nn.functional.one_hot(input_ids[0] % 4, 4).T  # [experts, seq]
        for e in (mask.sum(-1) > 0).nonzero():
            (rows,) = torch.where(mask[e].squeeze(0))
            if rows.numel() == 0:
                continue
            x = x.index_add(0, rows, x[rows] * (e.float() + 2.0))

        class Out:
            logits = x[None]

        return Out()


@pytest.mark.tiny
def test_value_branches_get_the_specialised_rung() -> None:
    """Rung 4: the branches follow the example's values, and a runtime assertion guards each."""
    model = _ExpertLoop().eval()
    frontend = build_frontend(model, lambda traced: None)
    traced = frontend.traced_for(8)[0]
    assert traced.frontend == "specialised", traced.frontend
    assert "branches on tensor values" in frontend.branch, frontend.branch
    graph = traced.graph_module
    same = (torch.arange(8) % 2).unsqueeze(0)  # the example's ids (vocabulary 2): its branches
    got = graph(*traced.placeholder_values(same))[0]
    want = model(same).logits
    assert torch.equal(got, want), f"max {(got - want).abs().max():.3g}"
    other = torch.zeros(1, 8, dtype=torch.long)  # one expert hit, not two: another branch
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        graph(*traced.placeholder_values(other))


class _LengthGuarded(torch.nn.Module):
    """Exports only up to 16 tokens: torch.export suggests ``max=16``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)
        self.pos = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, input_ids):
        x = self.emb(input_ids) + self.pos[: input_ids.shape[1]]

        class Out:
            logits = x

        return Out()


@pytest.mark.tiny
def test_bounded_rung_takes_the_suggested_range() -> None:
    model = _LengthGuarded().eval()
    with pytest.raises(Exception):  # noqa: B017 - the rung the ladder must get past
        export(
            LogitsOnly(model),
            (torch.zeros(1, 8, dtype=torch.long),),
            dynamic_shapes={"input_ids": {1: Dim("seq", min=1, max=32768)}},
            strict=False,
        )
    frontend = build_frontend(model, lambda traced: None)
    traced, _ = frontend.traced_for(None)
    assert traced.frontend == "bounded" and traced.seq_range[1] == 16, frontend.reasons
    assert frontend.traced_for(1) is frontend.traced_for(None)  # inside the range: shared
    with pytest.raises(CtxcError, match="every export rung failed"):
        frontend.traced_for(20)  # beyond it: a static export, which this model cannot have
