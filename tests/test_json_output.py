"""JSON-constrained output (Batch.add(json_object=True); the server's response_format json_object) on the tiny
model's tokenizer with a steering backend.

Oracle: the backend's logits rank, at output step i, some tokens a JSON object cannot take there first (decoys: an
added token, a raw control byte, a comma before any key, whitespace after the object) and the i-th token of a known
object T next, then its stop token. Unconstrained, greedy decoding takes the decoys; constrained, every decoy is
refused and the output is exactly T, ending on the stop token (json.loads(T) is the object). A step with more decoys
than the constrained draws (JSON_DRAWS) is settled by the likeliest allowed token: T's again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from ninfer_rt import batching
from ninfer_rt.sampling import SamplingParams
from serve_client import Running

T = '{"name": "ninfer", "n": [1, -2.5e3, true, null], "s": "a\\"b\\u00e9"}'
GREEDY = SamplingParams(greedy=True)


@dataclass
class _Cache:
    decoded: int = 0  # output tokens fed back (decode steps); prompt chunks come through forward


class Steer:
    """A backend whose logits steer output step i (the prompt's last chunk gives step 0, each decode step the
    next): decoys[i] first (falling), then target[i], everything else far below."""

    max_ctx, exclusive_slots, cache_slots = 4096, False, 2

    def __init__(self, vocab: int, target: list[int], decoys: list[list[int]]):
        self.vocab, self.target, self.decoys = vocab, target, decoys

    def new_cache(self, slot: int = 0) -> _Cache:
        return _Cache()

    def copy_cache(self, cache: _Cache, slot: int) -> _Cache:
        return _Cache(cache.decoded)

    def forward(self, ids, cache: _Cache, last_only: bool = False) -> np.ndarray:
        i = min(cache.decoded, len(self.target) - 1)
        row = np.full(self.vocab, -20.0, np.float32)
        row[self.target[i]] = 5.0
        for rank, d in enumerate(self.decoys[i]):
            row[d] = 10.0 - 0.01 * rank
        return row[None] if last_only else np.repeat(row[None], len(ids), 0)

    def decode_batch(self, ids, caches) -> np.ndarray:
        for c in caches:
            c.decoded += 1
        return np.concatenate([self.forward([t], c, last_only=True) for t, c in zip(ids, caches)])


class DeviceSteer(Steer):
    """Steer with the GPU backend's batched draws (GpuBackend.sample_batch's contract, greedy rows): only each
    row's arg-max comes back (with its logprobs record where asked), and a JSON row's logits only through
    last_logits, counted."""

    draws_logprobs = draws_constrained = True

    def __init__(self, *a):
        super().__init__(*a)
        self.steps = self.logits_reads = 0

    def can_draw(self, params) -> bool:
        return params.is_greedy and not params.penalised

    def sample_next(self, ids, cache, params, *, vocab, seed, step) -> int:
        """The arg-max after ids: a prompt's last chunk, or (one id) a decode step, as decode_batch counts it."""
        if len(ids) == 1:
            cache.decoded += 1
        return int(np.argmax(self.forward(ids, cache, last_only=True)[-1][:vocab]))

    def sample_batch(self, ids, caches, params, *, vocab, seeds, steps, hidden=False, logprobs=None):
        from ninfer_rt.logprobs import token_logprob

        self.steps += 1
        self.rows = self.decode_batch(ids, caches)
        out = [row.copy() if p is None else int(np.argmax(row[:vocab])) for p, row in zip(params, self.rows)]
        return [token_logprob(self.rows[b], t, n, vocab) if n is not None else t
                for b, (t, n) in enumerate(zip(out, logprobs or [None] * len(out)))]

    def last_logits(self, row: int) -> np.ndarray:
        self.logits_reads += 1
        return self.rows[row].copy()


def steering(model, cls=Steer, with_decoys: bool = True) -> tuple[Steer, list[int]]:
    """A Steer (or cls) toward T's tokens then the stop token, with decoys a JSON object cannot take at each step
    (or none)."""
    tok = model.tokenizer
    ids = tok.encode(T) + [min(tok.eos_ids)]
    assert tok.decode(ids[:-1]) == T
    by_bytes = {tok.token_bytes(i): i for i in range(model.real_vocab_size) if not tok.is_added(i)}
    control, comma, space = by_bytes[b"\x01"], by_bytes[b","], by_bytes[b" "]
    added = next(i for i in range(model.real_vocab_size) if tok.is_added(i) and not tok.is_stop(i))
    decoys = [[added, control] if i % 2 else [control] for i in range(len(ids))]
    decoys[0] = [comma, added]  # a comma cannot open the object
    decoys[-1] = [space, comma]  # after the object only the stop token
    # more decoys than the constrained draws: raw control bytes (not the whitespace ones), then an added token
    controls = [by_bytes[bytes([c])] for c in range(1, 32) if c not in b"\t\n\r"]
    decoys[len(ids) // 2] = controls[:batching.JSON_DRAWS + 4] + [added]
    return cls(model.real_vocab_size, ids, decoys if with_decoys else [[] for _ in ids]), ids


@pytest.fixture
def steered(packed_model, monkeypatch):
    steer, ids = steering(packed_model)
    monkeypatch.setattr(packed_model, "_backend", steer)
    return packed_model, ids


def run(model, json_object: bool, sampling=GREEDY, max_new_tokens: int = 64, json_schema=None, logprobs=None):
    batch = model.batch(1)
    g = batch.add(model.tokenizer.encode("Reply in JSON"), max_new_tokens=max_new_tokens, sampling=sampling,
                  json_object=json_object, json_schema=json_schema, logprobs=logprobs)
    text = ""
    while batch.busy:
        batch.step()
        text += "".join(g.take())
    return g, text


@pytest.mark.parametrize("decoys", [True, False])
def test_a_json_row_drawn_on_the_device_takes_the_host_paths_tokens(packed_model, monkeypatch, decoys):
    """Drawn on the device (DeviceSteer: arg-max ids alone back), a JSON row's output and logprobs are the host
    path's; its logits come back only at the steps whose draw the constraint refuses: every decode step where a
    decoy ranks first, none where T's token does."""
    def steered_run(cls):
        steer, ids = steering(packed_model, cls, decoys)
        monkeypatch.setattr(packed_model, "_backend", steer)
        g, text = run(packed_model, json_object=True, logprobs=1)
        return steer, ids, (g.stats.token_ids, text, g.stats.finish_reason, g.take_logprobs())

    _, ids, host = steered_run(Steer)
    device, _, got = steered_run(DeviceSteer)
    assert got == host and host[0] == ids[:-1] and host[1] == T
    assert device.steps == len(ids) - 1  # every token after the prompt's drawn there (the last the stop token)
    assert device.logits_reads == (device.steps if decoys else 0)


def test_a_json_dead_end_drawn_on_the_device_fails_its_request_alone(packed_model, monkeypatch):
    """A schema no document satisfies (two distinct empty strings) beside a plain sequence: drawn on the device,
    the JSON row fails at the step where no token continues it (the host path's tokens before it, its reason)
    and the plain one decodes on, as on the host."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 0}, "minItems": 2, "uniqueItems": True}

    def steered_run(cls):
        steer, _ = steering(packed_model, cls)
        monkeypatch.setattr(packed_model, "_backend", steer)
        batch = packed_model.batch(2)
        prompt = packed_model.tokenizer.encode("Reply in JSON")
        gens = [batch.add(prompt, max_new_tokens=64, sampling=GREEDY, json_schema=schema),
                batch.add(prompt, max_new_tokens=12, sampling=GREEDY)]
        while batch.busy:
            batch.step()
        return steer, [(g.stats.token_ids, g.stats.finish_reason, str(g.error)) for g in gens]

    _, host = steered_run(Steer)
    device, got = steered_run(DeviceSteer)
    assert got == host and host[0][1] == "error" and "continues the JSON reply" in host[0][2]
    assert len(host[0][0]) > 1 and host[1][1] == "length" and device.steps > 1  # it ended in a device step


def test_the_constraint_refuses_every_decoy(steered):
    model, ids = steered
    g, text = run(model, json_object=True)
    assert g.stats.token_ids == ids[:-1] and text == T and g.stats.finish_reason == "eos"
    assert json.loads(text)["s"] == 'a"bé'
    plain, text = run(model, json_object=False)
    assert plain.stats.token_ids[0] != ids[0]  # unconstrained, the first decoy wins


def test_sampled_draws_are_constrained_too(steered):
    """Sampling at temperature 1 over the top 3: the decoys hold nearly all the probability, and each draw the
    constraint refuses is masked and drawn again."""
    model, ids = steered
    g, text = run(model, json_object=True, sampling=SamplingParams(temperature=1.0, top_k=3, seed=5))
    assert text == T and g.stats.finish_reason == "eos"


def test_a_budget_that_ends_first_leaves_a_prefix(steered):
    model, ids = steered
    g, text = run(model, json_object=True, max_new_tokens=5)
    assert g.stats.token_ids == ids[:5] and g.stats.finish_reason == "length" and T.startswith(text)


def test_the_server_answers_a_json_object(steered):
    """response_format json_object on both endpoints: the object, whole and streamed, as the content (the prompt's
    reasoning closed, so the reply is not taken for reasoning); a json_schema without its schema, or an unknown
    format, is refused, not ignored."""
    model, _ = steered
    with Running(model) as r:
        chat = {"messages": [{"role": "user", "content": "JSON please"}], "temperature": 0,
                "response_format": {"type": "json_object"}}
        status, body = r.json("/v1/chat/completions", chat)
        assert status == 200 and body["choices"][0]["message"]["content"] == T
        assert body["choices"][0]["finish_reason"] == "stop"
        assert "reasoning_content" not in body["choices"][0]["message"]
        status, body = r.json("/v1/completions", {"prompt": "JSON:", "temperature": 0, "max_tokens": 64,
                                                   "response_format": {"type": "json_object"}})
        assert status == 200 and body["choices"][0]["text"] == T
        status, body = r.json("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}})
        assert status == 400 and body["error"]["message"] == ("response_format json_schema needs json_schema.schema, "
                                                              "a JSON Schema object")
        status, body = r.json("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}})
        assert status == 400 and body["error"]["param"] == "response_format"
        status, body = r.json("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
        assert status == 400 and body["error"]["param"] == "response_format"


# ------------------------------------------------------------------------------------------------ json_schema

# T's shape as a schema: a string, an array of numbers, booleans and nulls, a string, no other keys
T_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "s"],
            "properties": {"name": {"type": "string"}, "s": {"type": "string"},
                           "n": {"type": "array", "items": {"type": ["number", "boolean", "null"]}}}}
T2 = '{"name": 12}'
T2_SCHEMA = {"type": "object", "properties": {"name": {"type": "integer"}}, "required": ["name"],
             "additionalProperties": False}


def test_a_schema_holds_the_reply_to_it(steered):
    """T's own schema lets the steered reply through as json_object does; it validates (jsonschema)."""
    import jsonschema

    from ninfer_rt.json_schema import compile_schema
    model, ids = steered
    g, text = run(model, json_object=False, json_schema=compile_schema(T_SCHEMA))
    assert g.stats.token_ids == ids[:-1] and text == T and g.stats.finish_reason == "eos"
    jsonschema.validate(json.loads(text), T_SCHEMA)


def test_a_schema_refuses_what_a_json_object_takes(packed_model, monkeypatch):
    """Steered toward T2 with decoys at the value a JSON object may take (a string, true, null) but an integer
    may not: json_object takes the first decoy, the schema refuses all three and the reply is T2."""
    from ninfer_rt.json_schema import compile_schema
    tok = packed_model.tokenizer
    ids = tok.encode(T2) + [min(tok.eos_ids)]
    at = next(i for i in range(len(ids)) if tok.decode(ids[:i]) in ('{"name":', '{"name": '))
    by_bytes = {tok.token_bytes(i): i for i in range(packed_model.real_vocab_size) if not tok.is_added(i)}
    decoys = [[] for _ in ids]
    decoys[at] = [by_bytes[b'"'], by_bytes[b"t"], by_bytes[b"n"]]
    monkeypatch.setattr(packed_model, "_backend", Steer(packed_model.real_vocab_size, ids, decoys))
    g, text = run(packed_model, json_object=False, json_schema=compile_schema(T2_SCHEMA))
    assert text == T2 and g.stats.finish_reason == "eos"
    g, text = run(packed_model, json_object=True, max_new_tokens=at + 1)
    assert g.stats.token_ids[at] == by_bytes[b'"']


def test_the_server_answers_a_json_schema(steered):
    """response_format json_schema (OpenAI's shape: json_schema.name / .schema / .strict) on both endpoints; a
    schema outside the subset is a 400 naming its keyword; with a forced tool call a 400."""
    model, _ = steered
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": T_SCHEMA}}
    with Running(model) as r:
        chat = {"messages": [{"role": "user", "content": "JSON please"}], "temperature": 0, "response_format": fmt}
        status, body = r.json("/v1/chat/completions", chat)
        assert status == 200 and body["choices"][0]["message"]["content"] == T
        assert "reasoning_content" not in body["choices"][0]["message"]
        status, body = r.json("/v1/completions", {"prompt": "JSON:", "temperature": 0, "max_tokens": 64,
                                                   "response_format": fmt})
        assert status == 200 and body["choices"][0]["text"] == T
        bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "string", "not": {"const": "a"}}}}
        status, body = r.json("/v1/chat/completions", {**chat, "response_format": bad})
        assert status == 400 and body["error"]["param"] == "response_format"
        assert body["error"]["message"].startswith("json_schema: #: 'not' is not supported")
        status, body = r.json("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
        assert status == 400 and body["error"]["param"] == "response_format"
