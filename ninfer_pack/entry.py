"""The ninfer-pack console script: ninfer_rt.entry.launch (a Ctrl-C while the CLI imports is one word and 130)."""

from ninfer_rt.entry import launch


def pack() -> None:
    """ninfer-pack"""
    launch("ninfer_pack.cli")
