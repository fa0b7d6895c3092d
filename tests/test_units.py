"""helpers.units: the three ways the course writes a quantity."""
from helpers.units import GB, GiB, format_binary_bytes, format_decimal_bytes, format_seconds


def test_decimal_bytes_for_totals():
    assert [format_decimal_bytes(n) for n in (0, 512, 1953.125, 2e6, 31.4e9, 2e13)] == \
        ["0 B", "512 B", "1.95 kB", "2 MB", "31.4 GB", "20 TB"]


def test_binary_bytes_name_only_whole_units():
    assert [format_binary_bytes(n) for n in (1024, 3 * 2**20, 1020, 2**20 - 4, 2 * GiB)] == \
        ["1 KiB", "3 MiB", "1020 B", "1048572 B", "2 GiB"]


def test_seconds_in_the_unit_a_reader_thinks_in():
    assert [format_seconds(s) for s in (2.5, 0.0123, 4.2e-5, 7e-9)] == \
        ["2.5 s", "12.3 ms", "42 µs", "7 ns"]


def test_a_gib_is_more_than_a_gb():
    assert round(GiB / GB - 1, 3) == 0.074
