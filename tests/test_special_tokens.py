"""Special tokens in the text: Model.generate and Batch.add leave them out where asked (skip_special_tokens, vLLM's
default and serve's), keep them by default (HF's decode), and `ninfer-rt run` leaves them out unless --special.
Oracle: the tokenizer's own decode (HF tokenizers) of the generated ids, with and without skip_special_tokens."""

from __future__ import annotations

import pytest

from cli_runner import run_main
from ninfer_rt import cli
from ninfer_rt.sampling import SamplingParams

GREEDY = SamplingParams(greedy=True)
PROMPT = "The assistant reads the question"  # the tiny MoE's greedy reply to it holds special tokens


def test_generate_and_batch_leave_special_tokens_out_where_asked(packed_model):
    m, tok = packed_model, packed_model.tokenizer
    kept = "".join(m.generate(PROMPT, max_new_tokens=16, sampling=GREEDY))
    ids = m.last_stats.token_ids
    assert any(tok.decode([i]) and not tok.decode([i], skip_special_tokens=True) for i in ids)  # the case is real
    skipped = "".join(m.generate(PROMPT, max_new_tokens=16, sampling=GREEDY, skip_special_tokens=True))
    assert kept == tok.decode(ids) and skipped == tok.decode(ids, skip_special_tokens=True) != kept
    batch = m.batch()
    g = batch.add(tok.encode(PROMPT), max_new_tokens=16, sampling=GREEDY, skip_special_tokens=True)
    text = ""
    while batch.busy:
        batch.step()
        text += "".join(g.take())
    assert text == skipped
    with pytest.raises(Exception, match="skip_special_tokens must be True or False"):
        m.generate(PROMPT, max_new_tokens=1, skip_special_tokens="yes")


def test_run_prints_special_tokens_only_with_special(packed, packed_model, capsys):
    oracle = {flag: "".join(packed_model.generate(PROMPT, max_new_tokens=16, sampling=GREEDY,
                                                  skip_special_tokens=not flag)) for flag in (False, True)}
    for flag in (False, True):
        args = ["run", packed, "--device", "cpu", "--prompt", PROMPT, "--max-new-tokens", 16, "--greedy"]
        code, out, err = run_main(cli.main, "ninfer-rt", args + (["--special"] if flag else []), capsys)
        assert code == 0 and out == oracle[flag] + "\n", err
