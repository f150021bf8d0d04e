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
