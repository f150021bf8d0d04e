"""reference.stream and the lazy weights: one decoder layer at a time gives the whole model's numbers.

Oracle: ReferenceModel.forward_with_hidden on all the weights at once (the same ops in the same order, so the
results must be bit for bit equal), and artifact_weights / checkpoint_weights for the lazy mappings.
"""

from __future__ import annotations

import torch

from ninfer_pack.source import Checkpoint
from ninfer_rt.format import Artifact
from ninfer_rt.reference.model import ReferenceModel
from ninfer_rt.reference.stream import lm_head, run_layers
from ninfer_rt.reference.weights import (LazyArtifactWeights, LazyCheckpointWeights, artifact_weights,
                                         checkpoint_weights)

WINDOWS = [[5, 77, 300, 12, 9, 401, 3], [8, 1, 2], [44] * 5]


def test_layer_by_layer_is_the_whole_model(tiny_moe, one_thread):
    with Checkpoint.open(tiny_moe) as ckpt:
        lazy = LazyCheckpointWeights(ckpt, ("text",))
        done = []
        run = run_layers(ckpt.spec, lazy, WINDOWS, keep_stream=True, progress=lambda d, n: done.append((d, n)))
        assert lazy.live == {} and lazy.reads == len(lazy) - 1  # every text tensor but the lm_head, once
        L = ckpt.spec.num_hidden_layers
        assert done == [(i, L + 2) for i in range(1, L + 3)]
        model = ReferenceModel(ckpt.spec, checkpoint_weights(ckpt, ("text",)))
        streams = []
        with torch.no_grad():
            for w, h in zip(WINDOWS, run.hidden):
                logits, want, stream = model.forward_with_hidden(torch.tensor(w), return_layers=True)
                assert torch.equal(h, want)
                assert torch.equal((h @ lm_head(ckpt.spec, lazy).T).float(), logits)
                streams.append(stream)
        assert len(run.stream) == L + 1
        for i, got in enumerate(run.stream):
            assert torch.equal(got, torch.cat([s[i] for s in streams]))


def test_lazy_artifact_weights_decode_each_tensor_once(packed):
    with Artifact.open(packed) as art:
        whole = artifact_weights(art, ("text", "mtp"))
        lazy = LazyArtifactWeights(art, ("text", "mtp"))
        assert set(lazy) == set(whole) and len(lazy) == len(whole)
        for name in sorted(whole):
            assert torch.equal(lazy[name], whole[name]), name
        fused = sum(1 for e in art.tensors.values() if e.group in ("text", "mtp"))
        assert lazy.reads == fused < len(whole)  # a fused tensor's parts come in one decode
        storages = {t.untyped_storage().data_ptr() for t in lazy.live.values()}
        assert len(storages) == len(lazy.live)  # each part owns its memory
        lazy.release()
        assert lazy.live == {} and "nope" not in lazy
