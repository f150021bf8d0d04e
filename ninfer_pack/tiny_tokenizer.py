"""The tokenizer files of the built-in tiny checkpoint: a Qwen-style byte-level BPE small enough for VOCAB 500.

Everything is derived from a fixed English text by a deterministic merge learner (ties broken by the pair's
spelling), so every call returns the same bytes. The layout copies Qwen3.5/3.6 (facts §7): NFC normaliser, the
Qwen3.5 split regex then ByteLevel, 256 byte tokens first, merges next, then the 33 added tokens in Qwen's order.
"""

from __future__ import annotations

import json
from collections import Counter

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# Same split as Qwen3.5's tokenizer: letters with marks, digits one at a time.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

REGULAR_VOCAB = 464  # 256 byte tokens + 208 learned merges; the added tokens follow (ids 464..496)

# Qwen3.5/3.6 added tokens in id order; the XML-like ones are not special, so decoding keeps them as text.
ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
    "<|audio_pad|>",
]
NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

TINY_SPECIAL_IDS: dict[str, int] = {tok: REGULAR_VOCAB + i for i, tok in enumerate(ADDED_TOKENS)}

# Written for this file; chat, tool and reasoning words are here so the merges cover a rendered chat.
_CORPUS = """\
The assistant reads the question from the user, thinks about it, and then writes a short answer.
When the user asks for the weather, the assistant may call a function named get_weather with the city
as a parameter. The tool returns a response, and the assistant reports the temperature in the city.
A model that runs on one small machine must be fast, careful with memory, and honest about what it knows.
Numbers such as 12, 345 and 2026 are split into single digits before the merges are applied.
We quantize the weights of every layer into groups of thirty-two values that share one scale, then we
check the error against the original model. If the error is too large, the recipe keeps that tensor in
higher precision. The runtime loads the artifact, maps the tensors into memory, and starts to generate.
Each token is sampled with a temperature, a top-k limit and a nucleus threshold; a penalty lowers the score
of tokens that have already appeared in the conversation, so the model repeats itself less often.
System messages come first. They tell the assistant who it is and which tools it has. The user speaks
next, and the assistant answers in turn. Sometimes the assistant thinks step by step inside a think block
before it gives the final answer; that reasoning is hidden from older turns of the conversation.
The quick brown fox jumps over the lazy dog while the sun sets behind the hills and the river runs on.
Please write the function, test it with a few inputs, and explain the result in plain English.
"""


def _learn_merges(text: str, pre: pre_tokenizers.PreTokenizer, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE merges over the pre-tokenized words of text; ties go to the smallest pair, so it is stable."""
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(text))
    splits = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for word, count in words.items():
            sym = splits[word]
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += count
        if not pairs:
            raise RuntimeError("tiny tokenizer corpus is too small for the requested merges")
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word, sym in splits.items():
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            splits[word] = out
    return merges


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen3.5's pre-tokenizer: the split regex (isolated), then the byte-to-unicode map without its own regex."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def _build_tokenizer() -> Tokenizer:
    """Learn the vocabulary until it has REGULAR_VOCAB ids, then append the added tokens in Qwen's order."""
    pre = _pre_tokenizer()
    corpus = normalizers.NFC().normalize_str(_CORPUS)
    # Byte tokens ordered by their unicode stand-in, as in GPT-2 / Qwen vocabularies.
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    # A merge can rebuild an existing string ("ab"+"c" vs "a"+"bc"); learn more until the vocabulary is full.
    n_wanted = REGULAR_VOCAB - len(vocab)
    while len(vocab) < REGULAR_VOCAB:
        merges = _learn_merges(corpus, pre, n_wanted)
        vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        for a, b in merges:
            vocab.setdefault(a + b, len(vocab))
        n_wanted += REGULAR_VOCAB - len(vocab)
    model = BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    for content in ADDED_TOKENS:
        added = AddedToken(content, special=content not in NON_SPECIAL, normalized=False)
        if content in NON_SPECIAL:
            tok.add_tokens([added])
        else:
            tok.add_special_tokens([added])
    return tok


# Written for ninfer in the Qwen3.6 ChatML style (facts §7); rendered with trim_blocks/lstrip_blocks like HF.
CHAT_TEMPLATE = r"""{#- ninfer tiny ChatML template in the Qwen3.6 style (written for ninfer). -#}
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is none or content is undefined -%}
        {{- '' -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {%- if add_vision_id -%}{{- 'Picture ' ~ image_count.value ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' or 'video' in part -%}
                {%- set video_count.value = video_count.value + 1 -%}
                {%- if add_vision_id -%}{{- 'Video ' ~ video_count.value ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('unsupported content part: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('message content must be a string or a list of parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}
    {{- raise_exception('the chat has no messages') -}}
{%- endif -%}
{%- if messages[0].role == 'system' -%}
    {%- set system_text = render_content(messages[0].content).strip() -%}
{%- else -%}
    {%- set system_text = '' -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n# Tools\n\nThese functions are available to you:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with this format and nothing after it:\n\n<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue, which may span\nseveral lines\n</parameter>\n</function>\n</tool_call>\n\nRules:\n- put each <function=...></function> block inside <tool_call></tool_call> tags\n- give every required parameter\n- any reasoning goes before the call, never after it\n- without a suitable function, answer normally and do not mention functions' -}}
    {%- if system_text -%}
        {{- '\n\n' ~ system_text -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' ~ system_text ~ '<|im_end|>\n' -}}
{%- endif -%}
{#- Reasoning is shown only after the last real user query (a user turn that is not a tool response). -#}
{%- set ns = namespace(last_query_index=-1) -%}
{%- for message in messages[::-1] -%}
    {%- if ns.last_query_index < 0 and message.role == 'user' -%}
        {%- if not (message.content is string and message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) -%}
            {%- set ns.last_query_index = messages | length - 1 - loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('the system message must come first') -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ render_content(message.content) ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if preserve_thinking or loop.index0 > ns.last_query_index -%}
            {{- '<think>\n' ~ reasoning ~ '\n</think>\n\n' ~ content -}}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- if call.function is defined -%}
                    {%- set call = call.function -%}
                {%- endif -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- elif content -%}
                    {{- '\n\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n<function=' ~ call.name ~ '>\n' -}}
                {%- if call.arguments is mapping -%}
                    {%- for name, value in call.arguments | items -%}
                        {{- '<parameter=' ~ name ~ '>\n' -}}
                        {%- if value is string -%}
                            {{- value -}}
                        {%- else -%}
                            {{- value | tojson -}}
                        {%- endif -%}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif call.arguments is defined and call.arguments is not none -%}
                    {{- raise_exception('tool call arguments must be a mapping, not a string') -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ render_content(message.content) ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unexpected message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def _json_bytes(obj: dict) -> bytes:
    """Stable JSON bytes: insertion order, two-space indent, UTF-8, trailing newline."""
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def tiny_tokenizer_files() -> dict[str, bytes]:
    """The tiny checkpoint's tokenizer files by name: tokenizer.json, tokenizer_config.json, chat_template.jinja,
    generation_config.json; deterministic (the same bytes on every call)."""
    tok = _build_tokenizer()
    added_decoder = {
        str(TINY_SPECIAL_IDS[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": t not in NON_SPECIAL}
        for t in ADDED_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }
    generation_config = {
        "bos_token_id": TINY_SPECIAL_IDS["<|endoftext|>"],
        "pad_token_id": TINY_SPECIAL_IDS["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [TINY_SPECIAL_IDS["<|im_end|>"], TINY_SPECIAL_IDS["<|endoftext|>"]],
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }
    return {
        "tokenizer.json": (tok.to_str(pretty=True) + "\n").encode("utf-8"),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
        "chat_template.jinja": CHAT_TEMPLATE.encode("utf-8"),
        "generation_config.json": _json_bytes(generation_config),
    }
