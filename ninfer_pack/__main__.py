"""`python -m ninfer_pack`: the ninfer-pack command where its script is not on PATH, through the same launcher (a
Ctrl-C while the CLI imports is one word and 130, not an import traceback)."""

from ninfer_pack.entry import pack

pack()
