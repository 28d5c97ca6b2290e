"""The reference every artefact is checked against computes the LM head at the query rows alone,
bit for bit as the default forward's call over every row gives them (issue 36: a 3,500-token
article's reference held [n, vocab] float32 logits, 3.7 GB, to read k rows)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import ctxc
from ctxc.backends.reference import head_at_query_rows, reference_logits
from ctxc.passes.runtime.plain_head import PROBE_COLUMNS
from tests.fixtures.helpers import diff_msg, random_ids

pytestmark = pytest.mark.tiny


def _wide_llama(softcap: bool = False) -> torch.nn.Module:
    """A tiny Llama (or Gemma 2, with a final soft cap) whose head is past the probe's width."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=2 * PROBE_COLUMNS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
    )
    if softcap:
        config = tf.Gemma2Config(final_logit_softcapping=5.0, **common)
        return tf.Gemma2ForCausalLM(config).eval()
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()


@pytest.fixture(scope="module")
def wide() -> dict[bool, torch.nn.Module]:
    """``_wide_llama(softcap)`` built and traced once for the module, by ``softcap``: the two
    query lengths compile the same model (``ctxc.compile`` leaves it as it was, and caches its
    trace on it; the head is restored, as the test checks)."""
    return {}


@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_reference_is_the_default_forward_at_the_query_rows(k: int, softcap: bool, wide) -> None:
    if softcap not in wide:
        wide[softcap] = _wide_llama(softcap)
    model = wide[softcap]
    ids = random_ids(11, 60, vocab=2 * PROBE_COLUMNS)
    patch = ctxc.compile(model, context_ids=ids[:-k], query_ids=ids[-k:], verify=False).patch
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0, -k:].float()  # every row's head
    got = reference_logits(model, patch)
    assert torch.equal(got, want), diff_msg(f"reference k={k}", got, want)
    assert "forward" not in vars(model.get_output_embeddings()), "the head was left replaced"


def test_head_computes_only_the_query_rows_while_open() -> None:
    model = _wide_llama()
    x = torch.tensor([random_ids(3, 50, vocab=2 * PROBE_COLUMNS)])
    with torch.no_grad(), head_at_query_rows(model, 2) as replaced:
        rows = model(input_ids=x).logits.shape[1]
    with torch.no_grad():
        every = model(input_ids=x).logits.shape[1]
    assert replaced and (rows, every) == (2, 50), (replaced, rows, every)


def test_a_hooked_head_runs_as_it_is() -> None:
    model = _wide_llama()
    head = model.get_output_embeddings()
    head._hf_hook = object()  # what accelerate's dispatch leaves on a placed module
    x = torch.tensor([random_ids(4, 30, vocab=2 * PROBE_COLUMNS)])
    try:
        with torch.no_grad(), head_at_query_rows(model, 1) as replaced:
            rows = model(input_ids=x).logits.shape[1]
    finally:
        del head._hf_hook
    assert not replaced and rows == 30, (replaced, rows)
