"""The coverage matrix's CI subset: one family per block pattern, built the way the matrix builds
every ``*ForCausalLM`` class (benchmarks/coverage/matrix.py), must compile exactly."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.tiny

from testbed.coverage import run_entry as coverage  # noqa: E402
from testbed.coverage.entries import CI_SUBSET, entries  # noqa: E402

_ENTRIES = {e.family: e for e in entries(set(CI_SUBSET))}


def _fig(rec: dict) -> str:
    if rec["status"] in ("exact", "inexact"):
        return (
            f"{rec['family']} ({rec['cls']}): {rec['status']}, emitted max "
            f"{rec['max_abs_logit_diff']:.3g}, solver max {rec['solver_max_abs_logit_diff']:.3g}, "
            f"unpatched control max {rec['control_max_abs_logit_diff']:.3g}; "
            f"blocks {rec.get('blocks')}"
        )
    return f"{rec['family']} ({rec['cls']}): {rec}"


def test_ci_subset_is_known() -> None:
    missing = [f for f in CI_SUBSET if f not in _ENTRIES]
    assert not missing, f"the installed Transformers has no {missing}"
    assert not [f for f in CI_SUBSET if _ENTRIES[f].scope]


@pytest.mark.parametrize("family", CI_SUBSET)
def test_ci_family_compiles_exactly(family: str) -> None:
    rec = coverage.run_entry(_ENTRIES[family])
    assert rec["status"] == "exact", _fig(rec)
    assert rec["max_abs_logit_diff"] <= coverage.TOL, _fig(rec)
    assert rec["top1_match"], _fig(rec)
    # A context the random model hardly sees would make "exact" vacuous.
    assert rec["control_max_abs_logit_diff"] > 1e-2, "the context hardly matters: " + _fig(rec)
    blocks = rec["blocks"]
    assert blocks["count"] >= 2 and not blocks["rejected"], _fig(rec)


def test_every_rung_failing_shows_each_rung() -> None:
    """DBRX's eager expert loop defeats every export rung: the record keeps the branch as its
    reason (the refusal groups are unchanged) and each rung's own reason, which the cell shows."""
    (entry,) = entries({"dbrx"})
    rec = coverage.run_entry(entry)
    assert rec["status"] == "refused" and rec["error"] == "UntraceableError", rec
    assert rec["reasons"][0].startswith("export: the forward pass branches on tensor values"), rec
    names = [r.split(":", 1)[0] for r in rec["rungs"]]
    assert names[0].startswith("dynamic [") and names[-1].startswith("specialised ("), rec["rungs"]
    assert all(len(r) <= 181 and "\n" not in r for r in rec["rungs"]), rec["rungs"]
    assert coverage.cell(rec).endswith(f" [rungs: {'; '.join(rec['rungs'])}]"), coverage.cell(rec)
