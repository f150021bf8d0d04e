"""A checkpoint whose config ties the output projection to the embedding (as Qwen3.5's small members do): packed with
no lm_head, run with the embedding as its head.

Oracle: transformers on the same checkpoint. The bf16 recipe is lossless for a bf16 checkpoint and both sides compute
in fp32, so only summation order differs: rel 1e-4, as in test_reference_model.
"""

from __future__ import annotations

import json

import torch
import transformers as tf

from checkpoints import write_tied_checkpoint
from hf_tiny import assert_close_rel
from ninfer_pack.pipeline import prepare, write_artifact
from ninfer_rt import load
from ninfer_rt.format import Artifact


def test_a_tied_checkpoint_packs_and_runs_as_transformers_ties_it(tmp_path, one_thread):
    src = write_tied_checkpoint(tmp_path / "ck")
    config = json.loads((src / "config.json").read_text())
    art = tmp_path / "tied.ninfer"
    write_artifact(prepare(str(src), "bf16", art))
    with Artifact.open(art) as a:
        assert "lm_head.weight" not in a.tensors and a.spec.tie_word_embeddings
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()  # the oracle ties it
    ids = torch.randint(0, config["text_config"]["vocab_size"], (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
    model = load(art, "cpu")
    try:
        got = torch.from_numpy(model.logits(ids.tolist())[:, :want.shape[-1]])
    finally:
        model.close()
    assert_close_rel(got, want, 1e-4)
