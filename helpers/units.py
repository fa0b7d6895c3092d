"""Units: the course's byte and time constants, and the three ways it writes a quantity.

Two conventions, each where its field uses it:
* sizes of buffers and caches are powers of two (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes), as
  allocators, nccl-tests' message sizes and data sheets' caches are;
* totals and every bandwidth are decimal (kB, MB, GB, TB = 10^3 … 10^12 bytes; GB/s), as
  nccl-tests, the ZeRO paper and GPU data sheets print them. A GiB is 7.4 % more than a GB.
"""
from __future__ import annotations

KiB, MiB, GiB = 1024, 1024**2, 1024**3
KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12


def format_decimal_bytes(n: float) -> str:
    """Three significant digits in B, kB, MB, GB or TB (powers of 1000): memory totals."""
    for unit, scale in (("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def format_binary_bytes(n: float) -> str:
    """Whole KiB/MiB/GiB by name; anything else (a size snapped for p = 3) in plain bytes:
    message sizes, which are powers of two."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale:.0f} {unit}"
    return f"{n:.0f} B"


def format_seconds(seconds: float) -> str:
    """3 significant digits in the unit a reader thinks in (ns, µs, ms, s)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"
