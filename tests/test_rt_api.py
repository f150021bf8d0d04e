"""ninfer_rt.load on the CPU reference: logits and greedy tokens against transformers, sampling, stops, masking.

The oracle is transformers run in fp32 on the checkpoint it was written from: tiny random Qwen3.5 models (MoE and
dense, 8 layers so two full-attention layers, vocab 500) stored in bf16 and packed with the lossless bf16 recipe,
so both sides compute on the same bf16-rounded weights. Tolerance: both sides are fp32 over the same equations and
differ only in summation order (n·u with u = 2^-24, n ≤ 128 per reduction, through 8 layers: ~1e-6, facts file
§0), so ‖Δ‖/‖ref‖ ≤ 1e-4 has a wide margin while any real mistake moves logits by 1e-2 or more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_tiny
from checkpoints import write_checkpoint
from hf_tiny import assert_close_rel
from ninfer_pack.pipeline import quantize
from ninfer_pack.tiny_tokenizer import TINY_SPECIAL_IDS, tiny_tokenizer_files
from ninfer_rt import load
from ninfer_rt.api import Model, gpu_available
from ninfer_rt.errors import FormatError, NinferError
from ninfer_rt.sampling import Sampler, SamplingParams

HF_REL = 1e-4     # module docstring
PROMPT = 80       # crosses the 64-token DeltaNet chunk boundary
NEW = 20          # greedy tokens compared with transformers
REAL_VOCAB = max(TINY_SPECIAL_IDS.values()) + 1  # the tiny tokenizer has 497 ids; rows 497..499 are padding
GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    """build(moe) -> (transformers model loaded in fp32 from the written bf16 checkpoint, our Model of the bf16
    artifact), built once per kind for the whole module."""
    cache: dict[bool, tuple] = {}

    def build(moe: bool):
        if moe not in cache:
            root = tmp_path_factory.mktemp("moe" if moe else "dense")
            model = hf_tiny.make_causal_lm(moe)
            ckpt, _ = write_checkpoint(root / "ckpt", model, prefix="causal", experts="fused", dtype=torch.bfloat16)
            for name, data in tiny_tokenizer_files().items():  # the tiny tokenizer fits vocab 500 (497 real ids)
                (ckpt / name).write_bytes(data)
            quantize(str(ckpt), "bf16", root / "m.ninfer")
            hf = type(model).from_pretrained(ckpt, dtype=torch.float32).eval()
            cache[moe] = (hf, load(root / "m.ninfer"))
        return cache[moe]

    yield build
    for _, ours in cache.values():
        ours.close()


@pytest.fixture(params=[True, False], ids=["moe", "dense"])
def built(request, builder):
    return builder(request.param)


@pytest.fixture
def moe_model(builder) -> Model:
    return builder(True)[1]


def prompt_ids(n: int = PROMPT, seed: int = 7) -> list[int]:
    return torch.randint(0, REAL_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------------------- vs transformers


@torch.no_grad()
def test_logits_match_transformers(built):
    hf, ours = built
    ids = prompt_ids()
    got = ours.logits(ids)
    assert got.dtype == np.float32 and got.shape == (PROMPT, 500)
    assert_close_rel(torch.from_numpy(got), hf(torch.tensor([ids])).logits[0], HF_REL)


@torch.no_grad()
def test_greedy_generation_matches_transformers(built):
    hf, ours = built
    assert REAL_VOCAB == 497 and ours.real_vocab_size == REAL_VOCAB
    ids = prompt_ids()
    text = "".join(ours.generate(ids, max_new_tokens=NEW, sampling=GREEDY))
    stats = ours.last_stats
    # HF gets the same stop ids and the same padded-row exclusion (its own suppress_tokens processor)
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long), do_sample=False,
                      max_new_tokens=NEW, eos_token_id=list(ours.tokenizer.eos_ids),
                      suppress_tokens=list(range(REAL_VOCAB, 500)), pad_token_id=TINY_SPECIAL_IDS["<|endoftext|>"])
    hf_new = out[0, PROMPT:].tolist()
    assert stats.finish_reason == "length" and len(stats.token_ids) == NEW >= 16  # no early stop hides a mismatch
    assert stats.token_ids == hf_new
    assert text == ours.tokenizer.decode(hf_new)
    assert stats.prompt_tokens == PROMPT and stats.generated_tokens == NEW
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.decode_tok_s > 0


@torch.no_grad()
def test_greedy_applies_the_repetition_penalty_as_transformers(builder):
    # HF applies repetition_penalty as a logits processor in greedy search too: greedy = arg-max of penalised logits
    hf, ours = builder(True)
    ids = prompt_ids()
    plain = list(ours.generate_ids(ids, max_new_tokens=NEW, sampling=GREEDY))
    got = list(ours.generate_ids(ids, max_new_tokens=NEW, sampling=SamplingParams(greedy=True, repetition_penalty=1.5)))
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long), do_sample=False,
                      repetition_penalty=1.5, max_new_tokens=NEW, eos_token_id=list(ours.tokenizer.eos_ids),
                      suppress_tokens=list(range(REAL_VOCAB, 500)), pad_token_id=TINY_SPECIAL_IDS["<|endoftext|>"])
    assert ours.last_stats.finish_reason == "length" and len(got) == NEW
    assert got == out[0, PROMPT:].tolist()
    assert got != plain  # the penalty really changed the greedy picks


# ----------------------------------------------------------------------------------------------- sampling


def _boost_rows(model: Model, monkeypatch, rows: slice, amount: float, from_step: int = 0) -> None:
    """Wrap the backend so that, from forward call `from_step` on, logits of `rows` get +amount."""
    real, calls = model._backend.forward, {"n": 0}

    def forward(ids, cache, last_only=False):
        logits = real(ids, cache, last_only)
        if calls["n"] >= from_step:
            logits[:, rows] += amount
        calls["n"] += 1
        return logits

    monkeypatch.setattr(model._backend, "forward", forward)


def test_sampling_is_seeded_and_equals_sampling_the_uncached_logits(moe_model):
    m, ids = moe_model, prompt_ids(24, seed=3)
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=1234)
    a = list(m.generate_ids(ids, max_new_tokens=12, sampling=params))
    b = list(m.generate_ids(ids, max_new_tokens=12, sampling=params))
    c = list(m.generate_ids(ids, max_new_tokens=12, sampling=SamplingParams(**{**params.__dict__, "seed": 99})))
    assert a == b and a != c and len(a) == 12
    # independent replay: full uncached forwards over prompt + output so far, masked, one Sampler stream
    sampler, hist = Sampler(params), list(ids)
    for tok in a:
        row = m.logits(hist)[-1]
        row[REAL_VOCAB:] = -np.inf
        assert sampler.sample(row, hist, len(ids)) == tok
        hist.append(tok)


def test_padded_rows_are_never_sampled(moe_model, monkeypatch):
    m, ids = moe_model, prompt_ids(16, seed=5)
    _boost_rows(m, monkeypatch, slice(REAL_VOCAB, None), 50.0)
    assert int(np.argmax(m.logits(ids)[-1])) >= REAL_VOCAB  # without the mask a padded id would win
    for params in (GREEDY, SamplingParams(temperature=5.0, seed=0)):
        out = list(m.generate_ids(ids, max_new_tokens=8, sampling=params))
        assert len(out) == 8 and max(out) < REAL_VOCAB


class _DrawingBackend:
    """The reference backend plus the GPU backend's draw-on-device interface, drawing the arg-max over the first
    `vocab` ids of the uncached logits (an independent oracle), and recording each call's arguments."""

    def __init__(self, inner, max_ctx: int | None = None):
        self.inner, self.calls = inner, []
        self.max_ctx = inner.max_ctx if max_ctx is None else max_ctx  # a GPU backend's cache may be shorter

    def new_cache(self, slot: int = 0):
        return self.inner.new_cache(slot)

    def forward(self, ids, cache, last_only=False):
        return self.inner.forward(ids, cache, last_only)

    def can_sample(self, params: SamplingParams) -> bool:
        return params.repetition_penalty == 1  # what the test below varies

    def sample_next(self, ids, cache, params, *, vocab, seed, step):
        self.calls.append((vocab, seed, step))
        return int(np.argmax(self.inner.forward(ids, cache, last_only=True)[-1][:vocab]))


def test_a_backend_that_draws_gets_the_vocab_seed_and_step(moe_model, monkeypatch):
    """Where the backend can draw (the GPU), the loop hands it the real vocabulary, the run's seed and the index
    of the token being drawn, and the tokens equal greedy decoding on the logits; where it cannot (a penalty),
    the loop samples the logits itself."""
    m, ids = moe_model, prompt_ids(20, seed=11)
    want = list(m.generate_ids(ids, max_new_tokens=6, sampling=GREEDY))
    drawing = _DrawingBackend(m._backend)
    monkeypatch.setattr(m, "_backend", drawing)
    got = list(m.generate_ids(ids, max_new_tokens=6, sampling=SamplingParams(greedy=True, seed=5)))
    assert got == want and drawing.calls == [(REAL_VOCAB, 5, i) for i in range(6)]
    drawing.calls.clear()
    list(m.generate_ids(ids, max_new_tokens=3, sampling=SamplingParams(greedy=True)))
    seeds = {c[1] for c in drawing.calls}
    assert len(drawing.calls) == 3 and len(seeds) == 1 and 0 <= seeds.pop() < 2**63  # one fresh seed per run
    drawing.calls.clear()
    penalised = list(m.generate_ids(ids, max_new_tokens=4, sampling=SamplingParams(greedy=True,
                                                                                   repetition_penalty=1.3)))
    assert drawing.calls == [] and len(penalised) == 4


def test_generation_ends_at_the_backends_context(moe_model, monkeypatch):
    """A GPU cache of max_ctx positions (shorter than the model's context) bounds prompt + output: generation ends
    with "length" at its last position, and a prompt that fills it is refused up front."""
    m, ids = moe_model, prompt_ids(20, seed=11)
    assert m.context_length == m.spec.max_position_embeddings  # the reference holds the whole context
    want = list(m.generate_ids(ids, max_new_tokens=12, sampling=GREEDY))
    monkeypatch.setattr(m, "_backend", _DrawingBackend(m._backend, max_ctx=len(ids) + 5))
    assert m.context_length == len(ids) + 5
    got = list(m.generate_ids(ids, max_new_tokens=12, sampling=GREEDY))
    assert got == want[:5] and m.last_stats.finish_reason == "length"
    with pytest.raises(NinferError, match=f"prompt has {len(ids) + 5} tokens; the context holds {len(ids) + 5}"):
        m.generate_ids(ids + [5] * 5, max_new_tokens=1)


class _CountingBackend(_DrawingBackend):
    """The reference backend recording the length of every forward (no drawing: the host samples)."""

    can_sample = None

    def forward(self, ids, cache, last_only=False):
        self.calls.append(len(ids))
        return self.inner.forward(ids, cache, last_only)


def test_reuse_cache_prefills_only_what_extends_the_last_run(moe_model, monkeypatch):
    """An agent's next turn (the prompt, the reply, then more) prefills only the new tokens and decodes what a
    fresh run decodes; anything that does not extend what was fed starts afresh."""
    m, ids = moe_model, prompt_ids(20, seed=3)
    counting = _CountingBackend(m._backend)
    monkeypatch.setattr(m, "_backend", counting)
    first = list(m.generate_ids(ids, max_new_tokens=6, sampling=GREEDY, reuse_cache=True))
    assert m.last_stats.finish_reason == "length" and m.last_stats.cached_tokens == 0
    turn = ids + first + prompt_ids(5, seed=4)  # the 6th token was sampled, not fed: it is prefilled now
    fresh = list(m.generate_ids(turn, max_new_tokens=5, sampling=GREEDY))  # no reuse: a new cache
    list(m.generate_ids(ids, max_new_tokens=6, sampling=GREEDY, reuse_cache=True))  # (fresh dropped the first's)
    counting.calls.clear()
    again = list(m.generate_ids(turn, max_new_tokens=5, sampling=GREEDY, reuse_cache=True))
    assert again == fresh and m.last_stats.cached_tokens == len(ids) + 5
    assert counting.calls[0] == len(turn) - (len(ids) + 5) and counting.calls[1:] == [1] * 4
    # the same prompt again does not extend the run (the state cannot rewind): a full prefill
    counting.calls.clear()
    assert list(m.generate_ids(turn, max_new_tokens=5, sampling=GREEDY, reuse_cache=True)) == fresh
    assert m.last_stats.cached_tokens == 0 and counting.calls[0] == len(turn)


def test_reuse_cache_after_an_early_stop_and_after_logits(moe_model, monkeypatch):
    """A run closed by its caller leaves exactly what it fed (the last token it yielded was not); logits() or a
    run without reuse_cache starts afresh in slot 0 (on the GPU, resetting it), so nothing is reused after them."""
    m, ids = moe_model, prompt_ids(16, seed=5)
    counting = _CountingBackend(m._backend)
    monkeypatch.setattr(m, "_backend", counting)
    run = m.generate_ids(ids, max_new_tokens=10, sampling=GREEDY, reuse_cache=True)
    got = [next(run) for _ in range(3)]
    run.close()
    turn = ids + got + [7, 8]
    want = list(m.generate_ids(turn, max_new_tokens=3, sampling=GREEDY))  # fresh, and it drops the resident
    run = m.generate_ids(ids, max_new_tokens=10, sampling=GREEDY, reuse_cache=True)
    assert [next(run) for _ in range(3)] == got
    run.close()
    assert list(m.generate_ids(turn, max_new_tokens=3, sampling=GREEDY, reuse_cache=True)) == want
    assert m.last_stats.cached_tokens == len(ids) + 2
    m.logits([1, 2, 3])
    list(m.generate_ids(turn + want, max_new_tokens=1, sampling=GREEDY, reuse_cache=True))
    assert m.last_stats.cached_tokens == 0
    with pytest.raises(NinferError, match="reuse_cache must be True or False"):
        m.generate_ids(ids, reuse_cache=1)


def test_defaults_come_from_generation_config(moe_model):
    # the tiny generation_config.json says do_sample true, temperature 1.0, top_k 20, top_p 0.95
    d = moe_model.sampling_defaults
    assert (d.greedy, d.temperature, d.top_k, d.top_p) == (False, 1.0, 20, 0.95)


# ----------------------------------------------------------------------------------------------- stopping


def test_eos_ids_stop_generation(moe_model, monkeypatch):
    m, ids = moe_model, prompt_ids(16, seed=11)
    assert {TINY_SPECIAL_IDS["<|im_end|>"], TINY_SPECIAL_IDS["<|endoftext|>"]} <= set(m.tokenizer.eos_ids)
    free = list(m.generate_ids(ids, max_new_tokens=10, sampling=GREEDY))
    for stop_tok in ("<|im_end|>", "<|endoftext|>"):
        with monkeypatch.context() as mp:
            # from the 6th forward on, the stop id dominates: 5 tokens come out, then the stop id ends the run
            i = TINY_SPECIAL_IDS[stop_tok]
            _boost_rows(m, mp, slice(i, i + 1), 1e4, from_step=5)
            text = "".join(m.generate(ids, max_new_tokens=10, sampling=GREEDY))
        s = m.last_stats
        assert s.finish_reason == "eos" and s.token_ids == free[:5] and s.generated_tokens == 6
        assert text == m.tokenizer.decode(free[:5]) and stop_tok not in text


def test_stop_strings(moe_model):
    m, ids = moe_model, prompt_ids(16, seed=13)
    pieces = list(m.generate(ids, max_new_tokens=24, sampling=GREEDY))
    full = "".join(pieces)
    assert m.last_stats.finish_reason == "length" and len(pieces) >= 6
    # a stop string straddling the boundary between two streamed pieces
    cut = len("".join(pieces[:4]))
    stop = full[cut - 1:cut + 2]
    out = list(m.generate(ids, max_new_tokens=24, sampling=GREEDY, stop=["\x00never", stop]))
    assert "".join(out) == full[:full.find(stop)] and m.last_stats.finish_reason == "stop"
    assert m.last_stats.stop_string == stop
    assert all(stop not in p for p in out)
    # a stop string that never appears changes nothing
    assert "".join(m.generate(ids, max_new_tokens=24, sampling=GREEDY, stop=["\x00never"])) == full
    with pytest.raises(NinferError, match="stop must be a non-empty string"):
        m.generate(ids, stop=[""])


# ----------------------------------------------------------------------------------------------- prompts, errors


def test_chat_prompt_and_no_thinking(moe_model):
    m = moe_model
    msgs = [{"role": "user", "content": "What is the weather?"}]
    rendered = m.tokenizer.decode(m.prompt_ids(messages=msgs, enable_thinking=False))
    assert rendered.startswith("<|im_start|>user\nWhat is the weather?<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert m.tokenizer.decode(m.prompt_ids(messages=msgs)).endswith("<|im_start|>assistant\n<think>\n")
    assert m.prompt_ids("The user") == m.tokenizer.encode("The user")  # raw text: no template, no BOS


def test_bad_inputs(moe_model, tmp_path):
    m = moe_model
    with pytest.raises(NinferError, match="exactly one"):
        m.generate("a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(NinferError, match="exactly one"):
        m.generate()
    with pytest.raises(NinferError, match="token id 500 at position 1"):
        m.logits([1, 500])
    with pytest.raises(NinferError, match="empty"):
        m.generate("")
    with pytest.raises(NinferError, match="max_new_tokens"):
        m.generate("a", max_new_tokens=0)
    if not gpu_available():  # without a GPU, --device cuda is one line naming what is missing
        with pytest.raises(NinferError) as e:
            load(m.artifact.path, device="cuda")
        assert "\n" not in str(e.value) and ("CUDA" in str(e.value) or "cuda" in str(e.value))
    with pytest.raises(NinferError, match="choose cpu, cuda or auto"):
        load(tmp_path / "x.ninfer", device="tpu")
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"GGUF" + bytes(200))
    with pytest.raises(FormatError, match="not a ninfer artifact"):
        load(foreign)
    with pytest.raises(FormatError, match="no such file"):
        load(tmp_path / "missing.ninfer")
