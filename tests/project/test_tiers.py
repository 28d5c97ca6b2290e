"""The tiers hold (tests/fixtures/tiers.py): a seeded violation of each kind fails its test.

The cases run as test files through pytest in a fresh process with the tier plugin, as the
suite loads it, and the outcomes are read: a quick test that builds a model, one that takes a
fixture whose setup built one, a tiny test that builds a real-size config, a tiny test that
exports ONNX; the controls (the same work in its own tier)
pass, so the check is not failing everything. A test marked with two tiers stops the run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fixtures.tiers import pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]


_HEAD = """
import pytest
import torch
import transformers as tf

def tiny():
    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return tf.LlamaForCausalLM(config)

@pytest.fixture(scope="module")
def built():
    return tiny()
"""

# case -> (the test file's tests, their outcomes in order, the reason the output must give)
CASES = {
    "quick_builds": ("def test_x():\n    tiny()\n", ["FAILED"], "quick-tier test built a model"),
    "quick_takes_a_built_fixture": (
        "@pytest.mark.tiny\ndef test_a(built):\n    pass\n\n\ndef test_b(built):\n    pass\n",
        ["PASSED", "FAILED"],
        "takes fixture 'built', which builds a model",
    ),
    "tiny_builds_a_real_size_model": (
        "@pytest.mark.tiny\ndef test_x():\n    tf.LlamaForCausalLM(tf.LlamaConfig(\n"
        "        vocab_size=65536, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "        num_attention_heads=2, num_key_value_heads=1))\n",
        ["FAILED"],
        "built a real-size model",
    ),
    "tiny_exports_onnx": (
        "@pytest.mark.tiny\ndef test_x():\n    with pytest.raises(Exception):\n"
        "        # the call is what counts, not its outcome (the legacy exporter refuses None at\n"
        "        # once; the default one builds its registry of ONNX functions first, ~3 s)\n"
        "        torch.onnx.export(None, (), dynamo=False)\n",
        ["FAILED"],
        "exported ONNX: mark it slow",
    ),
    "control_tiny_builds": ("@pytest.mark.tiny\ndef test_x():\n    tiny()\n", ["PASSED"], ""),
    "control_quick_builds_nothing": ("def test_x():\n    assert 1 + 1 == 2\n", ["PASSED"], ""),
}
_INI = (
    "[pytest]\nmarkers =\n    tiny: tiny models\n    slow: the real model\n"
    "addopts = -p tests.fixtures.tiers -p no:cacheprovider -p no:xdist -rA\n"
)


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, files: dict) -> str:
    """The seeded ``files`` run by pytest in a fresh process with the tier plugin: its output."""
    pytester.makepyfile(**{name: _HEAD + "\n\n" + body for name, body in files.items()})
    pytester.makeini(_INI)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the child imports tests.fixtures.tiers
    monkeypatch.setenv("COLUMNS", "400")  # whole reasons on the summary lines
    result = pytester.runpytest_subprocess("-q", timeout=300)
    return result.stdout.str() + result.stderr.str()


@pytest.mark.tiny  # the seeded tests build tiny models (in the child process)
def test_each_seeded_violation_fails_and_each_control_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _run(pytester, monkeypatch, {f"test_{k}": body for k, (body, _, _) in CASES.items()})
    for case, (_, outcomes, reason) in CASES.items():
        got = [
            line.split()[0]
            for line in text.splitlines()
            if line.startswith(("PASSED", "FAILED", "ERROR")) and f"test_{case}.py::" in line
        ]
        assert got == outcomes, f"{case}: want {outcomes}, got {got}:\n{text[-3000:]}"
        assert reason in text, f"{case}: want {reason!r} in the output:\n{text[-3000:]}"


@pytest.mark.parametrize(("marks", "refused"), [(("tiny", "slow"), True), (("tiny",), False)])
def test_a_test_with_two_tiers_stops_the_run(marks: tuple[str, ...], refused: bool) -> None:
    item = SimpleNamespace(
        nodeid="test_x.py::test_x",
        get_closest_marker=lambda name: object() if name in marks else None,
    )
    if not refused:
        pytest_collection_modifyitems(None, [item])  # type: ignore[arg-type]
        return
    with pytest.raises(pytest.UsageError, match=r"1 test\(s\) marked both tiny and slow"):
        pytest_collection_modifyitems(None, [item])  # type: ignore[arg-type]
