"""Penalties on the device's terms: misc.penalty_state (a sequence's dense per-id state) and misc.penalize_reference
(penalize_rows' host twin, fp32 step by step) give sampling.apply_penalties' logits (float64, the definition) to
within fp32 rounding: two roundings of a value a few units in size, so |Δ| <= 4 ulp(|x| + |penalty|) of fp32."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.gpu import misc
from ninfer_rt.sampling import SamplingParams, apply_penalties

V = 300


@pytest.mark.parametrize("rep, presence, frequency", [(1.3, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 0.7),
                                                       (0.8, 1.5, 0.4), (1.0, -0.5, 0.0), (1.0, 0.0, 0.0)])
def test_the_dense_state_and_the_host_twin_give_apply_penalties(rep, presence, frequency):
    rng = np.random.default_rng(abs(int(rep * 10 + presence * 100 + frequency * 1000)))
    S = 3
    logits = (rng.standard_normal((S, V)) * 4).astype(np.float32)
    logits[0, :5] = [0.0, -0.0, 3.0, -3.0, np.nan]
    histories = [rng.integers(0, V, n).tolist() for n in (40, 1, 120)]
    prompt_lens = [25, 1, 60]
    params = np.concatenate([misc.penalty_params(rep, presence, frequency)] * S)
    state = [misc.penalty_state(h, pl, V) for h, pl in zip(histories, prompt_lens)]
    counts, seen = np.stack([c for c, _ in state]), np.stack([s for _, s in state])
    got = misc.penalize_reference(logits, V, [2, 0, 1], params, counts, seen)  # rows in other slots' order
    sp = SamplingParams(temperature=1.0, repetition_penalty=rep, presence_penalty=presence,
                        frequency_penalty=frequency)
    for m, s in enumerate([2, 0, 1]):
        want = apply_penalties(logits[m], histories[s], prompt_lens[s], sp)
        nan = np.isnan(want)
        assert np.array_equal(nan, np.isnan(got[m])) and nan.sum() == (m == 0)
        bound = 4 * np.spacing(np.float32(np.abs(want[~nan]) + abs(presence) + abs(frequency) * len(histories[s])))
        assert np.all(np.abs(got[m][~nan] - want[~nan]) <= bound)
        untouched = (seen[s] == 0) & (counts[s] == 0)
        assert np.array_equal(got[m][untouched], logits[m][untouched], equal_nan=True)  # untouched: bit for bit


def test_the_state_counts_the_output_and_sees_the_whole_history():
    counts, seen = misc.penalty_state([5, 6, 5, 7, 7, 7, 9], 3, 12)
    assert counts.tolist() == [0] * 7 + [3, 0, 1, 0, 0] and counts.dtype == np.int32
    assert seen.tolist() == [0] * 5 + [1, 1, 1, 0, 1, 0, 0] and seen.dtype == np.uint8
