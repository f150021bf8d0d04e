"""Tokenizer and chat template of the runtime against transformers loaded from the same files.

The tiny tokenizer's files are written to a temporary directory and loaded by transformers (the oracle);
ninfer_rt.tokenizer / ninfer_rt.chat read the same bytes without transformers. The sandbox templates run in:
test_chat_sandbox.py.
"""

from __future__ import annotations

import codecs
import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_tiny import VOCAB
from ninfer_pack.tiny_tokenizer import TINY_SPECIAL_IDS, tiny_tokenizer_files
from ninfer_rt.chat import ChatTemplate, load_chat_template
from ninfer_rt.errors import NinferError
from ninfer_rt.tokenizer import Tokenizer

# Offsets of added tokens from <|endoftext|> in the real Qwen3.5/3.6 vocabulary (facts §7: 248044 ...).
QWEN_ADDED_OFFSETS = {
    "<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|vision_start|>": 9, "<|image_pad|>": 12,
    "<tool_call>": 14, "</tool_call>": 15, "<tool_response>": 22, "</tool_response>": 23,
    "<think>": 24, "</think>": 25, "<|audio_pad|>": 32,
}

MIXED_TEXT = (
    "Hello, World! The assistant's answer: 2026 items at 3.14 € each.\n\tTabs  and   spaces\r\n"
    "naïve café, x\u0301y (a combining mark), हिन्दी, 日本語のテキスト, 한국어, Ελληνικά, 👋🏽 🇯🇵 👨‍👩‍👧"
)


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return tiny_tokenizer_files()


@pytest.fixture(scope="module")
def model_dir(files, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tok")
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


@pytest.fixture(scope="module")
def hf_fast(model_dir):
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_auto(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tok(files) -> Tokenizer:
    return Tokenizer.from_resources(files)


# --- tiny tokenizer files -------------------------------------------------------------------------------

def test_tiny_files_are_deterministic_and_qwen_shaped(files, tok):
    assert tiny_tokenizer_files() == files
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    assert tok.vocab_size <= VOCAB  # every id fits the tiny model's embedding
    first = TINY_SPECIAL_IDS["<|endoftext|>"]
    assert 440 <= first <= 480  # ~460 regular ids
    for token, offset in QWEN_ADDED_OFFSETS.items():
        assert tok.token_to_id(token) == first + offset == TINY_SPECIAL_IDS[token]
    assert sorted(TINY_SPECIAL_IDS.values()) == list(range(first, tok.vocab_size))
    # 256 byte tokens come first; each single byte encodes to one id below 256
    assert all(len(tok.encode(chr(b))) == 1 and tok.encode(chr(b))[0] < 256 for b in range(32, 127))

    gen = json.loads(files["generation_config.json"])
    assert gen["eos_token_id"] == [TINY_SPECIAL_IDS["<|im_end|>"], TINY_SPECIAL_IDS["<|endoftext|>"]]
    assert gen["bos_token_id"] == gen["pad_token_id"] == TINY_SPECIAL_IDS["<|endoftext|>"]
    assert (gen["do_sample"], gen["temperature"], gen["top_k"], gen["top_p"]) == (True, 1.0, 20, 0.95)
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["chat_template"] == files["chat_template.jinja"].decode()
    assert (cfg["eos_token"], cfg["pad_token"]) == ("<|im_end|>", "<|endoftext|>")


# --- tokenizer ------------------------------------------------------------------------------------------

def test_encode_decode_agree_with_transformers(tok, hf_fast, hf_auto):
    ids = tok.encode(MIXED_TEXT)
    assert ids == hf_fast(MIXED_TEXT, add_special_tokens=False)["input_ids"]
    assert ids == hf_auto(MIXED_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == MIXED_TEXT == hf_fast.decode(ids)
    assert len(ids) < len(MIXED_TEXT.encode("utf-8"))  # merges did apply


def test_a_long_encode_lets_other_threads_run(tok):
    """The server tokenizes a request on its connection's thread: a long prompt must not hold the GIL meanwhile
    (tokenizers' encode does, encode_batch does not). A thread that ticks every 5 ms must keep ticking: holding
    the GIL it gets at most the few ticks around the call, free it gets one per 5 ms of the encode."""
    import threading
    import time

    text = "a " * (1 << 19)
    ticks, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.02)
    try:
        start = time.perf_counter()
        ids = tok.encode(text)
        end = time.perf_counter()
    finally:
        done.set()
        t.join()
    assert ids == tok._tok.encode(text, add_special_tokens=False).ids
    during = sum(start < x < end for x in ticks)
    assert during >= min(10, (end - start) / 0.005 / 4), (during, end - start)


def test_special_tokens(tok, hf_fast):
    text = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\ndone<|endoftext|>"
    ids = tok.encode(text)
    assert ids == hf_fast(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == TINY_SPECIAL_IDS["<|im_start|>"] and ids[-1] == TINY_SPECIAL_IDS["<|endoftext|>"]
    assert TINY_SPECIAL_IDS["<think>"] in ids and TINY_SPECIAL_IDS["</think>"] in ids
    assert tok.decode(ids) == text
    # <think> is an added but non-special token, so it survives skip_special_tokens, as in Qwen
    assert tok.decode(ids, skip_special_tokens=True) == hf_fast.decode(ids, skip_special_tokens=True)
    assert "<think>" in tok.decode(ids, skip_special_tokens=True)
    assert tok.eos_ids == (TINY_SPECIAL_IDS["<|im_end|>"], TINY_SPECIAL_IDS["<|endoftext|>"])
    assert tok.is_stop(hf_fast.eos_token_id) and tok.is_stop(TINY_SPECIAL_IDS["<|endoftext|>"])
    assert not tok.is_stop(TINY_SPECIAL_IDS["<|im_start|>"]) and not tok.is_stop(tok.encode("a")[0])
    assert tok.pad_id == hf_fast.pad_token_id == TINY_SPECIAL_IDS["<|endoftext|>"]
    assert tok.bos_id == TINY_SPECIAL_IDS["<|endoftext|>"]  # from generation_config.json


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte -> printable-unicode map, inverted: the independent oracle for token bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def test_incremental_decode_streams_complete_utf8(tok, hf_fast):
    text = "Hi 👋🏽! 🇯🇵 日本 👨‍👩‍👧 ok 😀😀"
    ids = tok.encode(text)
    to_byte = _byte_of_char()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    detok = tok.detokenizer()
    streamed = ""
    n_held = 0
    for i in ids:
        piece = detok.push(i)
        # oracle: feed the token's raw bytes to Python's incremental UTF-8 decoder
        expected = utf8.decode(bytes(to_byte[c] for c in hf_fast.convert_ids_to_tokens(i)))
        assert piece == expected
        assert "\ufffd" not in piece
        n_held += piece == ""
        streamed += piece
    assert detok.finish() == ""
    assert streamed == text
    assert n_held > 0  # the test really split multi-byte characters across tokens
    assert "".join(tok.detokenizer().stream(ids)) == text


def test_incremental_decode_releases_a_replacement_at_once(tok):
    """U+FFFD the text holds, or bytes no later token can mend, go out at the token that brings them, as Python's
    incremental UTF-8 decoder (errors="replace") releases them byte by byte; only a character still open is held
    (a run of replacements was held whole, re-decoding a growing window at every token)."""
    id_of = {b: tok.token_to_id(c) for c, b in _byte_of_char().items()}
    data = b"a\xff\xfe b" + "\ufffd".encode() * 6 + b"\xe4\xb8" + b"x" + "中".encode() + b"\xf0\x9f"
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    detok = tok.detokenizer()
    for b in data:  # one single-byte token each
        assert detok.push(id_of[b]) == utf8.decode(bytes([b])), bytes([b])
    assert detok.finish() == utf8.decode(b"", final=True) == "\ufffd"


def test_incremental_decode_flushes_an_unfinished_character(tok):
    ids = tok.encode("a😀")
    detok = tok.detokenizer()
    out = "".join(detok.push(i) for i in ids[:-1])  # last byte of the emoji withheld
    assert out == "a"
    assert detok.finish() == "\ufffd"


@pytest.mark.parametrize("data", [None, b"{not json", b'{"model": {"type": "Nope"}}', b"\xff\xfe"])
def test_bad_tokenizer_json_is_one_line_error(files, data):
    res = dict(files)
    if data is None:
        del res["tokenizer.json"]
    else:
        res["tokenizer.json"] = data
    with pytest.raises(NinferError, match="tokenizer.json") as e:
        Tokenizer.from_resources(res)
    assert "\n" not in str(e.value)


# --- chat template --------------------------------------------------------------------------------------

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]

CHATS = {
    "plain": ([{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"},
               {"role": "user", "content": "Tell me a joke."}], {}),
    "system_user": ([{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Wie spät ist es? 🕒"}], {}),
    "thinking_off": ([{"role": "user", "content": "2+2?"}], {"enable_thinking": False}),
    "thinking_on": ([{"role": "user", "content": "2+2?"}], {"enable_thinking": True}),
    "old_reasoning_dropped": ([
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nhidden later\n</think>\n\nanswer one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two", "reasoning_content": "shown: after the last query"},
    ], {}),
    "preserve_thinking": ([
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer one", "reasoning_content": "kept"},
        {"role": "user", "content": "second"},
    ], {"preserve_thinking": True}),
    "tools": ([
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich and Bern?"},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two calls needed.",
         "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
         ]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 19}'},
    ], {"tools": TOOLS}),
    "tools_no_content": ([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "snow"},
        {"role": "assistant", "content": "It snows in Oslo."},
        {"role": "user", "content": "Thanks"},
    ], {"tools": TOOLS, "enable_thinking": False}),
}


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(files, hf_auto, tok, name, add_generation_prompt):
    messages, kwargs = CHATS[name]
    ours = ChatTemplate.from_resources(files).render(messages, add_generation_prompt=add_generation_prompt,
                                                     **kwargs)
    theirs = hf_auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    assert ours == theirs
    assert tok.encode(ours) == hf_auto(theirs, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("content", ["The weather is", "The weather is ", "Sure:\n", "im",
                                     [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two "}]])
@pytest.mark.parametrize("thinking", [None, False])
def test_continue_final_message_matches_transformers(files, hf_auto, content, thinking):
    """A prefill: the text ends inside the final assistant message, as transformers' continue_final_message cuts it
    (trailing whitespace the template trims is gone; "im" is not found inside <|im_end|>)."""
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": content}]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    ours = ChatTemplate.from_resources(files).render(messages, continue_final_message=True, **kwargs)
    theirs = hf_auto.apply_chat_template(messages, tokenize=False, continue_final_message=True, **kwargs)
    assert ours == theirs
    with pytest.raises(NinferError, match="add_generation_prompt must be false"):
        ChatTemplate.from_resources(files).render(messages, continue_final_message=True, add_generation_prompt=True)


@pytest.mark.parametrize("messages, why", [
    (None, "messages must be a list of dicts"), ([], "must be an assistant message with text"),
    ([{"role": "user", "content": "hi"}], "must be an assistant message with text"),
    ([{"role": "assistant", "content": [{"type": "image"}]}], "must have a text part"),
])
def test_continue_final_message_refuses_what_it_cannot_continue(files, messages, why):
    with pytest.raises(NinferError, match=why) as e:
        ChatTemplate.from_resources(files).render(messages, continue_final_message=True)
    assert "\n" not in str(e.value)


def test_generation_prompt_follows_qwen36(files):
    # The two generation prompts spelled out in facts §7.
    ct = ChatTemplate.from_resources(files)
    msgs = [{"role": "user", "content": "hi"}]
    assert ct.render(msgs, add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n")
    assert ct.render(msgs, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with_tools = ct.render(msgs, tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\n") and "<tools>\n" in with_tools


def test_template_source_selection(files):
    cfg = json.loads(files["tokenizer_config.json"])
    only_cfg = {"tokenizer_config.json": files["tokenizer_config.json"]}
    assert load_chat_template(only_cfg) == (cfg["chat_template"], "tokenizer_config.json chat_template")
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    listed = {"tokenizer_config.json": json.dumps(cfg).encode()}
    assert load_chat_template(listed)[0] == "D"
    assert load_chat_template(listed, "tool_use")[0] == "T"
    with pytest.raises(NinferError, match="no template named 'rag'"):
        load_chat_template(listed, "rag")
    with pytest.raises(NinferError, match="chat template: missing"):
        load_chat_template({"tokenizer.json": files["tokenizer.json"]})


def test_the_processors_chat_template_json_is_the_last_choice(files):
    """Processor-style checkpoints keep the template in chat_template.json ({"chat_template": ...}), as
    transformers' processors read it: used when neither chat_template.jinja nor tokenizer_config.json has one."""
    legacy = {"chat_template.json": json.dumps({"chat_template": "L{{ messages[0]['content'] }}"}).encode()}
    cfg = json.loads(files["tokenizer_config.json"])
    bare_cfg = json.dumps({k: v for k, v in cfg.items() if k != "chat_template"}).encode()
    assert load_chat_template({**legacy, "tokenizer_config.json": bare_cfg}) == (
        "L{{ messages[0]['content'] }}", "chat_template.json")
    assert ChatTemplate.from_resources(legacy).render([{"role": "user", "content": "hi"}]) == "Lhi"
    assert load_chat_template({**legacy, "tokenizer_config.json": files["tokenizer_config.json"]})[0] == \
        cfg["chat_template"]
    assert load_chat_template({**legacy, "chat_template.jinja": b"J"})[0] == "J"
    for bad, why in ((b"[1]", "expected a JSON object"), (b'{"chat_template": 3}', "expected a string chat_template"),
                     (b"{", "malformed JSON")):
        with pytest.raises(NinferError, match=f"chat_template.json: {why}"):
            load_chat_template({"chat_template.json": bad})


@pytest.mark.parametrize("eos_form", ["string", "AddedToken"])
def test_special_tokens_reach_the_template_as_in_transformers(files, tmp_path, eos_form):
    cfg = json.loads(files["tokenizer_config.json"])
    if eos_form == "AddedToken":  # older tokenizer_config.json files spell special tokens as AddedToken dicts
        cfg["eos_token"] = {"__type": "AddedToken", "content": cfg["eos_token"], "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
    source = "[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}]{{ messages[0].content }}"
    res = {**files, "tokenizer_config.json": json.dumps(cfg).encode(), "chat_template.jinja": source.encode()}
    for name, data in res.items():
        (tmp_path / name).write_bytes(data)
    msgs = [{"role": "user", "content": "x"}]
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(msgs, chat_template=source, tokenize=False)
    assert ChatTemplate.from_resources(res).render(msgs) == theirs
    assert "<|im_end|>" in theirs  # the eos really reached the template


@pytest.mark.parametrize("data, why", [(b"{not json", "malformed JSON"), (b"[1, 2]", "expected a JSON object")])
def test_bad_tokenizer_config_fails_alike_for_template_and_tokenizer(files, data, why):
    res = {**files, "tokenizer_config.json": data}
    with pytest.raises(NinferError, match=why) as chat_error:
        ChatTemplate.from_resources(res)
    with pytest.raises(NinferError) as tok_error:
        Tokenizer.from_resources(res)
    assert str(chat_error.value) == str(tok_error.value)
    assert str(chat_error.value).startswith("tokenizer_config.json:") and "\n" not in str(chat_error.value)


def test_tiny_template_rejects_bad_chats(files):
    ct = ChatTemplate.from_resources(files)
    with pytest.raises(NinferError, match="system message must come first"):
        ct.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(NinferError, match="unexpected message role: wizard"):
        ct.render([{"role": "wizard", "content": "a"}])


def test_least_tokens_bounds_the_count_from_below(tok, files):
    """least_tokens (the serve's refusal of a prompt that cannot fit, before tokenizing it) never exceeds the real
    count: on mixed text, on text NFC composes (decomposed accents, Hangul jamo: fewer bytes after the
    normalizer), on the longest piece repeated (where the bound is tight), on special tokens and on random code
    points; and it is no bound at all (0) behind a normalizer other than NFC."""
    import random
    import unicodedata

    from tokenizers import Tokenizer as HF
    from tokenizers.normalizers import Lowercase

    longest = max(tok._tok.get_vocab(with_added_tokens=True), key=lambda t: len(tok.token_bytes(tok.token_to_id(t))))
    rng = random.Random()
    texts = [MIXED_TEXT, unicodedata.normalize("NFD", "éàü한국어" * 300), "<|im_start|><|im_end|>" * 50,
             tok.decode([tok.token_to_id(longest)]) * 200,
             "".join(chr(rng.choice([rng.randrange(32, 0x2FF), rng.randrange(0x1100, 0x11FF), rng.randrange(
                 0x4E00, 0x9FFF), rng.randrange(0x1F300, 0x1F6FF)])) for _ in range(4000))]
    for text in texts:
        count = len(tok.encode(text))
        assert 0 < tok.least_tokens(text) <= count, (text[:40], tok.least_tokens(text), count)
    repeated = tok.decode([tok.token_to_id(longest)]) * 200
    assert tok.least_tokens(repeated) == len(tok.encode(repeated)) == 200
    lowered = HF.from_str(files["tokenizer.json"].decode())
    lowered.normalizer = Lowercase()
    assert Tokenizer(lowered, {}, {}).least_tokens(MIXED_TEXT) == 0


def test_message_objects_render_as_their_dicts(files, hf_auto):
    """Messages as dataclasses, as objects with pydantic's model_dump, and tool calls as read-only mappings render
    as the plain dicts transformers converts them to."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class Message:
        role: str
        content: str

    class Dumped:  # pydantic's protocol
        def __init__(self, **fields):
            self.fields = fields

        def model_dump(self):
            return dict(self.fields)

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    plain = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "snow"}]
    objects = [Message("user", "Weather in Oslo?"),
               Dumped(role="assistant", content="", tool_calls=[types.MappingProxyType(call)]),
               Dumped(role="tool", content="snow")]
    ours = ChatTemplate.from_resources(files).render(objects, tools=TOOLS, add_generation_prompt=True)
    assert ours == hf_auto.apply_chat_template(plain, tools=TOOLS, tokenize=False, add_generation_prompt=True)
