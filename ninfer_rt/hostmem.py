"""Host memory: what the CPU reference paths check before they decode a model into fp32."""

from __future__ import annotations

from ninfer_rt.errors import NinferError


def available_memory() -> int | None:
    """Bytes of RAM available to a new allocation (MemAvailable in /proc/meminfo); None where unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(need: int, what: str, avail: int | None) -> None:
    """NinferError "WHAT: needs ~N GB, M GB available" when need exceeds avail (None: unknown, no check)."""
    if avail is not None and need > avail:
        raise NinferError(f"{what}: needs ~{need / 1e9:.3g} GB, {avail / 1e9:.3g} GB available")
