"""A tied checkpoint on the GPU: no lm_head in the artifact, the embedding's entry read as the output projection
(gpu/loader.py). The tiny dense checkpoint with its head tied, packed with the tiny recipe; our kernels against the
PyTorch reference on the same artifact, bound as in test_engine: mean KL(reference || GPU) <= 1e-3 for a prompt's
rows (the GEMV and the GEMM paths) and for each decode step's row.
"""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints import write_tied_checkpoint

from .test_engine import gpu_model, kld, prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    from ninfer_pack.pipeline import quantize

    src = write_tied_checkpoint(tmp_path_factory.mktemp("tied") / "ck")
    out = tmp_path_factory.mktemp("art") / "tied.ninfer"
    quantize(str(src), "tiny", out)
    return out


@pytest.mark.parametrize("chunk", [8, 64], ids=["gemv", "gemm"])  # as test_engine's prefill test picks the kernels
def test_a_tied_heads_logits_match_the_reference(gpu, kernels, tied, chunk):
    from ninfer_rt.api import load
    from ninfer_rt.format import Artifact

    with Artifact.open(tied) as art:
        assert "lm_head.weight" not in art.tensors and art.spec.tie_word_embeddings
    ids = prompt(96, 5)
    reference = load(tied, device="cpu")
    try:
        want = reference.logits(ids.tolist())
    finally:
        reference.close()
    model, weights = gpu_model(gpu, kernels, tied, logit_rows=chunk)
    try:
        got = model.prefill(ids[:64], 0, all_logits=True)
        steps = []
        for p in range(64, 72):  # decode steps read the same head
            model.decode(ids[p:p + 1], [p], [0])
            steps.append(model.logits(1)[0])
    finally:
        model.free()
        weights.free(gpu)
    assert np.isfinite(got).all() and kld(want[:64], got).mean() <= 1e-3
    d = kld(want[64:72], np.stack(steps))
    assert np.isfinite(d).all() and d.max() <= 1e-3, d
