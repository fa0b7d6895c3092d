"""Notebook 02's fit file (helpers.cost.alpha_beta.save_fit / load_fit): written atomically,
in results/ at the root (or $PLAB_RESULTS_DIR), one record per network level, a format-1
file still read, and a corrupt one reported and ignored. Every test writes under tmp_path."""
import json
import threading
import warnings
from pathlib import Path
from unittest import mock

import pytest

from helpers.cost import alpha_beta as ab
from helpers.cost import tp as tp_cost

ROOT = Path(__file__).resolve().parent.parent
FITS = {"all_reduce": ab.Fit("all_reduce", 1e-4, 1e-9),
        "all_gather": ab.Fit("all_gather", 5e-5, 2e-9)}
RECORD = {"backend": "gloo", "world_size": 4, "cores_per_rank": 0.5,
          "fit": {op: f.as_dict() for op, f in FITS.items()}}


@pytest.fixture(autouse=True)
def no_results_dir(monkeypatch):
    monkeypatch.delenv(ab.RESULTS_ENV, raising=False)


def test_default_place_is_results_at_the_repository_root():
    # As the README says, not helpers/results/. Only the path is computed: nothing is written.
    assert ab.default_fit_path() == ROOT / "results" / "collective_fit.json"


def test_the_environment_variable_moves_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ab.RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert ab.default_fit_path() == tmp_path / "elsewhere" / "collective_fit.json"
    assert ab.load_fit() is None
    assert ab.save_fit(FITS, "gloo", 4, 0.5) == tmp_path / "elsewhere" / "collective_fit.json"
    assert ab.load_fit() == RECORD
    assert tp_cost.load_fit().all_reduce == FITS["all_reduce"]


def test_outside_a_checkout_the_user_data_folder_is_used(tmp_path, monkeypatch):
    # A non-editable install: the package sits in site-packages, with no pyproject.toml above.
    installed = tmp_path / "site-packages" / "helpers" / "cost" / "alpha_beta.py"
    monkeypatch.setattr(ab, "__file__", str(installed))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert ab.results_dir() == tmp_path / "data" / "parallelism-lab" / "results"


def test_levels_round_trip_and_keep_each_other(tmp_path):
    path = tmp_path / "fit.json"
    link = {"all_reduce": ab.Fit("all_reduce", 3e-3, 4e-8)}
    ab.save_fit(FITS, "gloo", 4, 0.5, path)
    ab.save_fit(link, "gloo", 2, 1, path, level="link", latency_added_s=1e-3)
    assert ab.load_fit(path) == RECORD
    assert ab.load_fit(path, level="loopback") == RECORD
    assert ab.load_fit(path, level="link")["latency_added_s"] == 1e-3
    assert ab.fits_from_record(ab.load_fit(path, level="link")) == link
    assert tp_cost.load_fit(path, level="link").all_reduce == link["all_reduce"]
    assert ab.load_fit(path, level="rack") is None
    data = json.loads(path.read_text())
    assert data["format"] == 2 and sorted(data["levels"]) == ["link", "loopback"]
    ab.save_fit(link, "gloo", 4, 0.5, path)  # a new loopback fit replaces only loopback
    assert ab.fits_from_record(ab.load_fit(path)) == link
    assert ab.load_fit(path, level="link")["world_size"] == 2


def test_a_level_needs_a_name(tmp_path):
    with pytest.raises(ValueError, match="level must be a non-empty name"):
        ab.save_fit(FITS, "gloo", 4, 0.5, tmp_path / "fit.json", level="")


def test_an_old_format_file_is_read_as_the_loopback_level(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(RECORD | {"world_sizes": [2, 4]}))  # as notebook 02 wrote it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ab.load_fit(path) == RECORD | {"world_sizes": [2, 4]}
        assert ab.load_fit(path, level="link") is None
        assert tp_cost.load_fit(path).cores_per_rank == 0.5
    ab.save_fit({"all_reduce": FITS["all_reduce"]}, "gloo", 2, 1, path, level="link")
    assert ab.load_fit(path)["world_sizes"] == [2, 4]  # rewritten as format 2, nothing lost


@pytest.mark.parametrize("content", [
    b"", b'{"backend": "gloo", "world_size": 4, "fit": {"all_re', b"\xff\xfe{}", b"[1, 2]",
    b"null", b'{"fit": {"all_reduce": {"alpha_s": "fast"}}}', b'{"levels": {"loopback": 3}}',
    b'{"format": 2}', b"[" * 100_000 + b"]" * 100_000,
], ids=["empty", "truncated", "not-utf8", "list", "null", "bad-number", "bad-level",
        "no-levels", "deep"])
def test_a_corrupt_file_is_reported_once_and_ignored(tmp_path, content):
    path = tmp_path / "collective_fit.json"
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="collective_fit.json is corrupt") as caught:
        assert ab.load_fit(path) is None
    assert len(caught) == 1 and str(path) in str(caught[0].message)
    with pytest.warns(UserWarning, match="corrupt"):
        assert tp_cost.load_fit(path) is None
    with pytest.warns(UserWarning, match="corrupt"):  # saving replaces the corrupt file
        ab.save_fit(FITS, "gloo", 4, 0.5, path)
    assert ab.load_fit(path) == RECORD


def test_an_interrupted_write_leaves_the_old_file(tmp_path):
    path = ab.save_fit(FITS, "gloo", 4, 0.5, tmp_path / "fit.json")
    with mock.patch.object(ab.os, "fsync", side_effect=KeyboardInterrupt), \
            pytest.raises(KeyboardInterrupt):
        ab.save_fit({"all_reduce": FITS["all_reduce"]}, "nccl", 8, None, path)
    assert ab.load_fit(path) == RECORD
    assert [p.name for p in tmp_path.iterdir()] == ["fit.json"]  # no temporary file left


def test_a_reader_during_many_writes_never_sees_a_partial_file(tmp_path):
    # Large records, so that a write in place would take several system calls.
    path = tmp_path / "fit.json"
    ab.save_fit(FITS, "gloo", 4, 0.5, path)
    done, seen, broken = threading.Event(), [], []

    def write():
        for k in range(50):
            ab.save_fit(FITS, "gloo", 4, 0.5, path, level=f"level {k % 3}",
                        samples=list(range(k, k + 3000)))
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a corrupt-file warning fails the test
        while not done.is_set():
            try:
                seen.append(ab.load_fit(path, level="loopback"))
            except UserWarning as e:
                broken.append(e)
    writer.join()
    assert broken == [] and len(seen) > 10
    assert all(record == RECORD for record in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fit.json"]
