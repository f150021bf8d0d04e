"""Tokenizer and chat template of the runtime against transformers loaded from the same files.

The tiny tokenizer's files are written to a temporary directory and loaded by transformers (the oracle);
ninfer_rt.tokenizer / ninfer_rt.chat read the same bytes without transformers.
"""

from __future__ import annotations

import codecs
import json
import time

import jinja2
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


MALICIOUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages.__class__ }}",
    "{{ ''['__class__'] }}",
    "{{ '{0.__class__.__mro__}'.format(1) }}",
    "{{ (messages | attr('__class__')) }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace(__dict__=1) %}",
    "{{ messages.append(1) }}",
]


@pytest.mark.parametrize("source", MALICIOUS)
def test_sandbox_escape_raises(source, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(NinferError) as e:
        ChatTemplate(source.replace("{marker}", str(marker))).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("source, message", [
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("{% if %}", "syntax error"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
])
def test_template_errors_are_one_line(source, message):
    with pytest.raises(NinferError, match=message) as e:
        ChatTemplate(source, origin="chat_template.jinja").render([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value) and str(e.value).startswith("chat_template.jinja:")


def test_tiny_template_rejects_bad_chats(files):
    ct = ChatTemplate.from_resources(files)
    with pytest.raises(NinferError, match="system message must come first"):
        ct.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(NinferError, match="unexpected message role: wizard"):
        ct.render([{"role": "wizard", "content": "a"}])


# Each would take seconds to minutes, or gigabytes, if run. Jinja's `**` is left-associative: `10**10**8` is
# (10**10)**8 = 10**80, harmless; `10**(10**8)` is the one that computes for minutes.
HUGE = [
    "{{ ('a'*1000000000)|length }}",
    "{{ 10**(10**8) }}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    "{{ ('%1000000000s' % '')|length }}",
    "{{ ('%*d' % (1000000000, 1))|length }}",
    "{{ ('%1000000000s'|format(''))|length }}",
    "{{ '{:>1000000000}'.format('')|length }}",
    "{{ '{:>{w}}'.format('', w=1000000000)|length }}",
    "{{ ''.ljust(1000000000)|length }}",
    "{{ ('\t' * 1000).expandtabs(tabsize=1000000)|length }}",
    "{{ ''|center(1000000000)|length }}",
    "{{ ('a\n' * 100000)|indent(100000)|length }}",
    "{{ [1]|batch(1000000000, 0)|list|length }}",
    "{{ [1]|slice(slices=1000000000)|list|length }}",
    # a container holding one long string 10,000 times (10 GB as text), turned into text each way a template has
    "{% set s = 'x' * 1000000 %}{{ [s] * 10000 }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|string|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|tojson|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|upper|length }}",
    "{% set s = 'x' * 1000000 %}{{ ('%s' % ([s] * 10000,))|length }}",
    "{% set s = 'x' * 1000000 %}{{ ('%s'|format([s] * 10000))|length }}",
    "{% set s = 'x' * 1000000 %}{{ '{}'.format([s] * 10000)|length }}",
    "{% set s = 'x' * 1000000 %}{{ (([s] * 10000) ~ '')|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([[s] * 100] * 100)|join|length }}",
    "{% set ns = namespace(a='x' * 1000000) %}{{ [ns] * 10000 }}",
]

# The render's budget: loop iterations and calls, values built by ~, + and join, everything built, the output and
# what is written into blocks. These stop after bounded work (at most ~1,000,000 steps), not before any.
BUDGET = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}"
    "{% endfor %}x",
    "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(l=[0]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join|length }}",
    # the second review's: a large int or a dict view printed, str methods that grow, sum over lists, tojson's indent
    "{{ [10 ** 4000] * 600000 }}",
    "{{ dict.fromkeys(range(2500), 'a' * 1000000).values() }}",
    "{{ ('a' * 2500).replace('a', 'a' * 1000000)|length }}",
    "{{ ('a' * 2500)|replace('a', 'a' * 1000000)|length }}",
    "{{ ('a' * 1000000).join('b' * 2500)|length }}",
    "{{ ('{0}' * 300000).format('a' * 10000)|length }}",
    "{{ ('{0:1000000}' * 2500).format('')|length }}",
    "{{ (('%(a)s' * 200000) % {'a': 'a' * 12500})|length }}",
    "{{ ('a' * 2500).translate(''.maketrans({'a': 'a' * 1000000}))|length }}",
    "{{ ([[0] * 1000000] * 130)|sum(start=[])|length }}",
    "{{ ([[0] * 1000000] * 130)|sum(none, [])|length }}",
    "{{ ([0] * 2500)|tojson(indent=1000000)|length }}",
    "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
    # ... a recursive loop's own calls, text written into a block, join over a generator, one long ~ chain, recursion
    "{% for n in [[0] * 10000] * 1000 recursive %}{% if n is iterable %}{{ loop(n) }}{% endif %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% set big %}{% for i in range(300) %}{{ s }}{% endfor %}{% endset %}{{ big|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 200)|map('string')|join|length }}",
    "{% set s = 'x' * 1000000 %}{% set t = s * 1 %}{{ (s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ "
    "s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ "
    "s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s)|length }}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(28) }}",
]


@pytest.mark.parametrize("source, seconds", [(h, 2.0) for h in HUGE] + [(b, 10.0) for b in BUDGET])
def test_sandbox_refuses_huge_results_quickly(source, seconds):
    t0 = time.perf_counter()
    with pytest.raises(NinferError, match="blocked by the sandbox") as e:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    # HUGE: refused before any work; BUDGET: after a bounded amount (a million steps take ~3 s at worst, macro
    # calls); the payloads themselves take hours or all the memory
    assert time.perf_counter() - t0 < seconds
    assert "\n" not in str(e.value)


# The same operators, methods and filters at ordinary sizes, up to the limits themselves (1,000,000 items,
# 65,536-bit integers).
WITHIN_LIMITS = (
    "{{ '-' * 3 }}|{{ 3 * [1, 2] }}|{{ 2 ** 100 }}|{{ 2 ** -2 }}|{{ 2.5 ** 3 }}|{{ 7 % 3 }}|{{ 1.5 * 2 }}|"
    "{{ '%5s|%-3d|%.2f|%%' % ('ab', 7, 3.14159) }}|{{ '%*d' % (4, 2) }}|{{ '%(k)s' % {'k': 'v'} }}|"
    "{{ '{:>6}|{!r}'.format('x', 'y') }}|{{ '{0}{1}{0}'.format('a', 'b') }}|{{ 'x'.ljust(4) }}|"
    "{{ 'x'.center(5, '*') }}|{{ '7'.zfill(3) }}|"
    "{{ 'a\tb'.expandtabs(4) }}|{{ 'a'|center(5) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\nb'|indent('> ') }}|"
    "{{ [1, 2, 3]|batch(2, 0)|list }}|{{ [1, 2, 3]|slice(2)|list }}|{{ '%s!'|format('q') }}|"
    "{{ [{'a': 1}, {'a': 2}]|sum('a') }}|{{ [1, 2]|sum(start=10) }}|{{ [{'a': 1}]|sum('a', 5) }}|"
    "{{ ('a' * 1000000)|length }}|{{ ('%1000000s' % '')|length }}|{{ (2 ** 65535) > 0 }}"
)


LOOPS = (
    "{% for k, v in {'a': 1, 'b': 2}|dictsort %}{{ loop.index }}/{{ loop.length }}/{{ loop.revindex0 }}:{{ k ~ v }}"
    "{{ loop.cycle('x', 'y') }}{% if loop.last %}.{% endif %}{% endfor %}"
    "{% for i in [] %}never{% else %}empty{% endfor %}"
    "{% for n in [[1, [2]], [3]] recursive %}[{% if n is iterable %}{{ loop(n) }}{% else %}{{ n }}{% endif %}]{% endfor %}"
    "{% for c in 'abc' if c != 'b' %}{{ c + '!' }}{{ ['p', 'q']|join('-') ~ loop.index }}{% endfor %}"
)


def test_sandbox_budget_keeps_jinja_loop_semantics():
    # oracle: jinja without any sandbox; loops see the budget's generator, so loop.length, else, recursion and
    # filtered loops must come out the same
    assert ChatTemplate(LOOPS).render([]) == jinja2.Environment().from_string(LOOPS).render()


def test_sandbox_loop_budget_is_exact():
    # 1,000,000 loop iterations and calls together a render: a list of exactly that many runs, one more is refused
    loop = "{% for i in items %}{% endfor %}ok"
    t = ChatTemplate(loop)
    assert t.render([], items=[0] * 1_000_000) == "ok"
    with pytest.raises(NinferError, match="more than 1,000,000 loop iterations and calls"):
        t.render([], items=[0] * 1_000_001)
    # each render starts with the whole budget
    assert [t.render([], items=[0] * 1_000_000) for _ in range(2)] == ["ok"] * 2
    # calls count as well: 1,000 range() calls and 999,000 iterations are 1,000 over
    with pytest.raises(NinferError, match="loop iterations and calls"):
        ChatTemplate("{% for i in range(1000) %}{% for j in range(999) %}{% endfor %}{% endfor %}").render([])


def test_sandbox_deadline_and_memory_backstops(monkeypatch):
    # a render that stays inside every count still stops at the wall-time and resident-memory limits
    import ninfer_rt.sandbox as sandbox

    slow = "{% for i in range(100000) %}{% set x = ('a' * 100000).split('a') %}{% endfor %}"
    monkeypatch.setattr(sandbox, "_MAX_SECONDS", 0.3)
    t0 = time.perf_counter()
    with pytest.raises(NinferError, match="the render ran longer than 0 s"):
        ChatTemplate(slow).render([])
    assert time.perf_counter() - t0 < 3
    monkeypatch.setattr(sandbox, "_MAX_SECONDS", 60.0)
    # resident memory as the guard reads it: 1 GiB at the render's start, then 1 GiB more at each reading (the
    # process's real RSS depends on what the allocator kept from earlier tests, so it is not the oracle here)
    readings = iter(range(1, 100))
    monkeypatch.setattr(sandbox, "_rss", lambda: next(readings) << 30)
    grow = "{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = ns.l + [('a' * 1000000) ~ i] %}" \
           "{% endfor %}{{ ns.l|length }}"
    with pytest.raises(NinferError, match="grew the process by more than 2 GiB"):
        ChatTemplate(grow).render([])
    assert next(readings) <= 5  # refused at the second large value after the start: 2 GiB is not yet refused


ACCUMULATE = (
    "{% set ns = namespace(out='', roles=[]) %}{% for m in messages %}"
    "{% set ns.out = ns.out + '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' %}"
    "{% set ns.roles = ns.roles + [m.role] %}{% endfor %}{{ ns.out }}{{ ns.roles|length }}"
    "{% set ns2 = namespace(s='') %}{% for m in messages %}{% set ns2.s = ns2.s ~ m.content ~ '\n' %}{% endfor %}"
    "{{ ns2.s|length }}{{ template }}"
)


def test_sandbox_leaves_accumulating_templates_alone():
    # oracle: jinja without any sandbox. Templates that build the prompt piece by piece copy O(n^2) characters:
    # 5,000 messages must still render, as they do in transformers
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 8} for i in range(5_000)]
    want = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(ACCUMULATE).render(
        messages=msgs, template="T")
    assert ChatTemplate(ACCUMULATE).render(msgs, template="T") == want


def test_sandbox_size_checks_leave_ordinary_sizes_alone():
    # oracle: jinja without any sandbox
    assert ChatTemplate(WITHIN_LIMITS).render([]) == jinja2.Environment().from_string(WITHIN_LIMITS).render()
    for just_over in ("{{ 'a' * 1000001 }}", "{{ [0] * 1000 * 1001 }}", "{{ 2 ** 65536 }}", "{{ 'x'.ljust(1000001) }}"):
        with pytest.raises(NinferError, match="blocked by the sandbox"):
            ChatTemplate(just_over).render([])


def test_nesting_too_deep_is_one_line():
    looped = {"role": "user", "content": "x"}
    looped["self"] = looped
    deep: list = []
    cur = deep
    for _ in range(5000):
        cur.append([])
        cur = cur[0]
    for messages in ([looped], [{"role": "user", "content": "x", "extra": deep}]):
        with pytest.raises(NinferError, match="nest too deeply"):
            ChatTemplate("{{ messages|length }}").render(messages)
    with pytest.raises(NinferError, match="nests too deeply to compile"):
        ChatTemplate("{{ " + "(" * 300 + "1" + ")" * 300 + " }}")


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
