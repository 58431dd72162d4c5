"""Reading and writing the quantities flags and plans are made of: byte sizes, parameter counts, bandwidths.

Sizes use SI prefixes as powers of 1000 (``80GB`` = 80e9 bytes) and IEC prefixes as powers of 1024
(``80GiB`` = 85.9e9 bytes); a bare number is bytes. Parameter counts take K / M / B (billion) / T
suffixes or scientific notation (``7B`` = ``7e9``). Bandwidths are a size per second (``25GB/s``)
or bits per second (``200Gb/s``, ``200Gbps``): bits only where a lower-case ``b`` or ``bit`` says so.
"""

from __future__ import annotations

import math
import re


class PlanInputError(ValueError):
    """A planner input the user typed is wrong; the message names the flag, the value and the fix."""


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(
    r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(.*?)\s*$"
)


def _split(text: str | int | float, flag: str, example: str) -> tuple[float, str]:
    if isinstance(text, bool):
        raise PlanInputError(f"{flag}={text!r} is not a number. Give e.g. {example}.")
    if isinstance(text, (int, float)):
        return float(text), ""
    match = _NUMBER.match(str(text))
    if match is None:
        raise PlanInputError(f"{flag}={text!r} is not a number with an optional unit. Give e.g. {example}.")
    return float(match.group(1).replace("_", "")), match.group(2)


def parse_size(text: str | int | float, flag: str = "size") -> int:
    """``"80GB"`` -> 80_000_000_000; ``"80GiB"`` -> 85_899_345_920; ``"1024"`` -> 1024 bytes."""
    value, unit = _split(text, flag, "80GB or 80GiB")
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise PlanInputError(
            f"{flag}={text!r} has an unknown unit {unit!r}. Use B, KB, MB, GB, TB (powers of 1000) or"
            " KiB, MiB, GiB, TiB (powers of 1024), e.g. 80GB."
        )
    if not math.isfinite(value) or value <= 0:
        raise PlanInputError(f"{flag}={text!r} must be a positive size, e.g. 80GB.")
    return int(value * factor)


def parse_count(text: str | int | float, flag: str = "count") -> int:
    """``"7B"`` / ``"7e9"`` -> 7_000_000_000; ``"125M"`` -> 125_000_000."""
    value, unit = _split(text, flag, "7e9 or 7B")
    factor = _COUNT_UNITS.get(unit.lower())
    if factor is None:
        raise PlanInputError(
            f"{flag}={text!r} has an unknown suffix {unit!r}. Use K, M, B (billion) or T, or a plain"
            " number such as 7e9."
        )
    count = int(round(value * factor))
    if count < 1:
        raise PlanInputError(f"{flag}={text!r} must be at least 1.")
    return count


def parse_bandwidth(text: str | int | float, flag: str = "bandwidth") -> float:
    """Bytes per second: ``"25GB/s"`` -> 25e9; ``"200Gb/s"`` and ``"200Gbps"`` -> 25e9 (bits / 8)."""
    value, unit = _split(text, flag, "25GB/s or 200Gb/s")
    unit = unit.removesuffix("/s")
    bits = False
    if unit.endswith("bps"):
        unit, bits = unit[:-3], True
    elif unit.endswith("bit"):
        unit, bits = unit[:-3], True
    elif unit.endswith("b") and not unit.endswith("B"):  # "Gb" is gigabits, "GB" gigabytes
        unit, bits = unit[:-1], True
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise PlanInputError(
            f"{flag}={text!r} has an unknown unit. Give bytes per second (25GB/s) or bits per second"
            " (200Gb/s, 200Gbps)."
        )
    if not math.isfinite(value) or value <= 0:
        raise PlanInputError(f"{flag}={text!r} must be a positive bandwidth, e.g. 25GB/s.")
    return value * factor / (8 if bits else 1)


def format_bytes(n: float) -> str:
    """``112e9`` -> ``"112.0 GB"`` (SI, to match how sizes are typed)."""
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{int(n)} B"


def format_count(n: float) -> str:
    """``7e9`` -> ``"7.00B"`` parameters."""
    for unit, factor in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= factor:
            return f"{n / factor:.2f}{unit}"
    return str(int(n))
