"""Log-probabilities of generated tokens (ninfer_rt.logprobs) and the bytes a token stands for (Tokenizer.token_bytes).

Oracles: torch.log_softmax in float64 over the real vocabulary (token_logprob's float32 exponentials, summed in
float64, are within 1e-5: an exponent x - max rounds by up to 2e-6 at |x - max| = 40, and terms that far down are
tiny); for a generation, the reference model's logits of the whole prompt + output in one forward (fp32: logprobs
agree within 1e-4, reassociation of sums of ~2K terms of logits ~10 in size).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_rt import load
from ninfer_rt.errors import NinferError
from ninfer_rt.logprobs import MAX_TOP_LOGPROBS, token_logprob
from ninfer_rt.sampling import SamplingParams


def oracle(logits: np.ndarray, vocab: int) -> np.ndarray:
    """log_softmax over the real vocabulary of a row [V] or of rows [T, V], in float64."""
    return torch.log_softmax(torch.from_numpy(logits[..., :vocab].astype(np.float64)), -1).numpy()


def test_token_logprob_is_log_softmax_over_the_real_vocabulary():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(300) * 4).astype(np.float32)
    logits[280:] = 1e4  # padding rows past the real vocabulary never count
    want = oracle(logits, 280)
    got = token_logprob(logits, 17, 5, 280)
    assert got.id == 17 and got.logprob == pytest.approx(want[17], abs=1e-5)
    top = np.argsort(-want, kind="stable")[:5]
    assert [i for i, _ in got.top] == top.tolist()
    np.testing.assert_allclose([lp for _, lp in got.top], want[top], rtol=0, atol=1e-5)
    assert token_logprob(logits, 17, 0, 280).top == ()


def test_top_alternatives_break_ties_to_the_lower_id():
    logits = np.zeros(10, np.float32)
    logits[[7, 3, 5]] = 2.0
    got = token_logprob(logits, 0, 2, 10)
    assert [i for i, _ in got.top] == [3, 5]
    assert got.top[0][1] == pytest.approx(2.0 - np.log(3 * np.e ** 2 + 7), abs=1e-5)
    assert [i for i, _ in token_logprob(logits, 0, 10, 4).top] == [3, 0, 1, 2]  # fewer ids than asked for


@pytest.mark.parametrize("top", [-1, MAX_TOP_LOGPROBS + 1])
def test_token_logprob_refuses_a_count_out_of_range(top):
    with pytest.raises(ValueError, match="top logprobs"):
        token_logprob(np.zeros(4, np.float32), 0, top, 4)


def test_token_bytes_spell_the_text_back(packed):
    m = load(packed, "cpu")
    tok = m.tokenizer
    text = "héllo wörld, 日本語 and an emoji 🙂 <|im_end|> done"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a byte of a character split across tokens
    m.close()


def test_a_batch_reports_each_output_tokens_logprob(packed):
    """Greedy and sampled generations report the logprobs of exactly the tokens they output, as the whole
    sequence's forward gives them; a generation without logprobs reports none."""
    m = load(packed, "cpu", cache_slots=3)
    try:
        prompts = [m.tokenizer.encode(t) for t in ("The garden at dawn", "A list: 1, 2,", "Once")]
        batch = m.batch()
        gens = [batch.add(prompts[0], max_new_tokens=6, sampling=SamplingParams(greedy=True), logprobs=3),
                batch.add(prompts[1], max_new_tokens=5, logprobs=0,
                          sampling=SamplingParams(temperature=0.8, top_k=40, seed=3)),
                batch.add(prompts[2], max_new_tokens=4, sampling=SamplingParams(greedy=True))]
        got = {id(g): [] for g in gens}
        while batch.busy:
            batch.step()
            for g in gens:
                got[id(g)] += g.take_logprobs()
        vocab = m.real_vocab_size
        for g, ids in zip(gens[:2], prompts):
            out = g.stats.token_ids
            whole = m.logits(ids + out[:-1])[len(ids) - 1:]  # row t: the logits token t was drawn from
            entries = got[id(g)]
            assert [e.id for e in entries] == out and len(out) > 0
            for e, row in zip(entries, whole):
                want = oracle(row, vocab)
                assert e.logprob == pytest.approx(want[e.id], abs=1e-4)
                assert len(e.top) == g.logprobs
                for i, lp in e.top:
                    assert lp == pytest.approx(want[i], abs=1e-4)
                    assert want[i] >= np.sort(want)[-g.logprobs] - 1e-4  # among the most likely
        assert got[id(gens[2])] == []
    finally:
        m.close()


def test_a_batch_refuses_a_logprobs_count_out_of_range(packed):
    m = load(packed, "cpu")
    try:
        with pytest.raises(NinferError, match="logprobs"):
            m.batch().add(m.tokenizer.encode("x"), logprobs=MAX_TOP_LOGPROBS + 1)
    finally:
        m.close()


def test_a_batch_scores_a_prompt(packed):
    """prompt_logprobs: every prompt token's logprob (the first NaN) as one forward of the prompt gives them, over
    more than one 64-token chunk and without reusing a slot that holds part of the prompt; max_new_tokens 0
    generates nothing."""
    m = load(packed, "cpu", cache_slots=2)
    try:
        text = " ".join(f"word{i}" for i in range(40))
        ids = m.tokenizer.encode(text)
        assert len(ids) > 64
        batch = m.batch()
        first = batch.add(ids[:30], max_new_tokens=2, sampling=SamplingParams(greedy=True))
        while batch.busy:
            batch.step()
        g = batch.add(ids, max_new_tokens=0, prompt_logprobs=2)
        got = []
        while batch.busy:
            batch.step()
            got += g.take_prompt_logprobs()
        want = oracle(m.logits(ids), m.real_vocab_size)
    finally:
        m.close()
    assert first.error is None and g.error is None and g.stats.cached_tokens == 0
    assert (g.stats.finish_reason, g.stats.token_ids, g.stats.generated_tokens) == ("length", [], 0)
    assert [e.id for e in got] == ids and np.isnan(got[0].logprob) and got[0].top == ()
    for p, e in enumerate(got[1:], 1):
        assert e.logprob == pytest.approx(want[p - 1, ids[p]], abs=1e-4)
        assert [lp for _, lp in e.top] == pytest.approx(np.sort(want[p - 1])[::-1][:2], abs=1e-4)
