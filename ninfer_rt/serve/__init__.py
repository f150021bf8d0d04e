"""ninfer-rt serve: OpenAI- and Anthropic-compatible HTTP over ninfer_rt.api.

    common.py     the Job both front ends reduce a request to; prepare (template, tokens, limits)
    openai.py     /v1/chat/completions, /v1/completions: requests in, replies and stream chunks out
    anthropic.py  /v1/messages, /v1/messages/count_tokens: the same for Anthropic's Messages API
    replies.py    the generated text split into reasoning, answer text and Qwen XML tool calls, incrementally
    worker.py     one generation at a time, on the thread that loaded the model
    server.py     routes, authentication, CORS, bodies, JSON and server-sent events; Server
"""

from ninfer_rt.serve.server import Server

__all__ = ["Server"]
