"""Errors that reach users as one line and a non-zero exit.

Every error a user can cause (bad path, foreign file, unsupported config, bad recipe) is raised as a
NinferError subclass with a message that names the culprit; the CLIs print `error: <message>` and exit 1.
Anything else is a bug and keeps its traceback.
"""


class NinferError(Exception):
    """Base class: the message is complete, one line, and names the field, tensor or path at fault."""


class ConfigError(NinferError):
    """config.json is missing a field, has an unsupported architecture, or disagrees with the tensors."""


class SourceError(NinferError):
    """The checkpoint cannot be read: missing path, unreachable Hub, malformed safetensors, missing tensors."""


class FormatError(NinferError):
    """An artifact is foreign, truncated, corrupted, or was written by an incompatible version."""


class RecipeError(NinferError):
    """A recipe is malformed, names an unknown format, or leaves a tensor unmatched."""


def json_reason(e: BaseException) -> str:
    """Why json.loads or tomllib refused a text, in one line: nesting past the parser's depth and Python's 4,300-digit
    integer limit in words of our own (their messages name interpreter internals), else the parser's first line."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return "an integer of more than 4300 digits" if "integer string conversion" in text else text
