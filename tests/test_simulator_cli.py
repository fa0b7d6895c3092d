"""The simulator's command line, tried adversarially: every input ends in "exit 0 with a valid
JSON file" or "exit 2 with one line naming the field", never a traceback, never a partial
file. Hypothesis throws generated command lines and configurations at `main(argv)` in-process
(fast); a few real subprocess runs check what a shell sees."""
import contextlib
import functools
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.hardware import PRESETS
from helpers.simulator import __main__ as cli
from helpers.simulator.config import gpu_to_json
from helpers.simulator.curve import run_curve

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "python -m helpers.simulator: error: "


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def run_in_process(argv: list[str], folder: Path) -> tuple[int, str, str]:
    """`main(argv)` run in `folder`, with only the first grid points computed (the search
    code is the same; the full curve is what the subprocess tests run)."""
    out, err = io.StringIO(), io.StringIO()
    quick = functools.partial(run_curve, max_compute=3e25)
    with mock.patch.object(cli, "run_curve", quick), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), _cwd(folder):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def _cwd(folder):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def check_outcome(rc: int, err: str, folder: Path, target: str = "out.json") -> None:
    """The contract: a result, or one line naming what is wrong; nothing half-written."""
    leftovers = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers
    if rc == 0:
        data = strict_json((folder / target).read_text())
        assert len(data["configurations"]) == 1
        assert err == ""
    else:
        assert rc == 2, err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(PREFIX), err
        assert "Traceback" not in err


# -- generated inputs ---------------------------------------------------------------------------

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=1e-12, max_value=1e12),
    st.integers(min_value=-2, max_value=10**30), st.just(10**400),
    st.sampled_from([0, 1, 2, 6, 8, 1e-300, 5e-324, 1e300]))
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
values = st.one_of(numbers, junk)
flag_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["3", "0", "-1", "1e-9", "1e-12", "nan", "inf", "1e400", "0.8", "x", ""]))

GPU_FIELDS = list(gpu_to_json(PRESETS["H100 SXM"]))
SETTING_FIELDS = ["tokens_per_param", "batch_law", "depth_coef", "depth_exp", "sparse",
                  "schedules", "overlap_tp", "overlap_pp", "overlap_dp", "months", "threshold",
                  "price_per_gpu", "bogus"]


@st.composite
def network(draw):
    inner = draw(st.lists(st.fixed_dictionaries({
        "bandwidth_Bps": st.one_of(st.sampled_from([9e11, 1e11, "Infinity"]), values),
        "latency_s": st.one_of(st.sampled_from([1e-6, 0]), values),
        "size": st.one_of(st.sampled_from([1, 2, 4, 6, 8, 32, 2**31]), values)}),
        max_size=9))
    last = {"bandwidth_Bps": draw(st.sampled_from([1e11, 4.5e11])), "latency_s": 1e-6}
    return inner + [last]


@st.composite
def configs(draw):
    data = gpu_to_json(PRESETS[draw(st.sampled_from(sorted(PRESETS)))])
    for field in draw(st.lists(st.sampled_from(GPU_FIELDS), max_size=3, unique=True)):
        data[field] = draw(network() if field == "network_levels" else values)
    if draw(st.booleans()):
        data["settings"] = draw(st.one_of(junk, st.dictionaries(
            st.sampled_from(SETTING_FIELDS),
            st.one_of(values, st.sampled_from(["default", "none", "1f1b"]),
                      st.lists(st.sampled_from(["1f1b", "interleaved", "zero_bubble", "x"]),
                               max_size=3)),
            max_size=3)))
    return data


@st.composite
def flags(draw):
    argv = []
    for flag in draw(st.lists(st.sampled_from(
            ["--months", "--threshold", "--price-per-gpu", "--batch-law"]), max_size=3)):
        argv += [flag, draw(st.sampled_from(["default", "none", "x"]) if flag == "--batch-law"
                            else flag_values)]
    if draw(st.booleans()):
        argv.append("--sparse")
    if draw(st.booleans()):
        argv += draw(st.lists(st.sampled_from(["--bogus", "-x", "--json", "--preset"]),
                              max_size=1))
    return argv


FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(preset=st.one_of(st.sampled_from(sorted(PRESETS)), st.text(max_size=8)), extra=flags())
def test_any_command_line_gives_a_result_or_one_line(preset, extra):
    with tempfile.TemporaryDirectory() as d:
        rc, _, err = run_in_process(["--preset", preset, "--json", "out.json", "--quiet", *extra],
                                    Path(d))
        check_outcome(rc, err, Path(d))


@FAST
@given(config=configs(), extra=flags())
def test_any_config_file_gives_a_result_or_one_line(config, extra):
    with tempfile.TemporaryDirectory() as d:
        text = json.dumps(config)  # NaN and Infinity as Python's json writes them
        (Path(d) / "gpu.json").write_text(text)
        rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json", "--quiet",
                                     *extra], Path(d))
        check_outcome(rc, err, Path(d))
        assert (Path(d) / "gpu.json").read_text() == text  # the input is never touched


# -- named cases from the issue -------------------------------------------------------------------

def config_with(**changes) -> dict:
    return gpu_to_json(PRESETS["H100 SXM"]) | changes


def levels(*sizes) -> list[dict]:
    return ([{"bandwidth_Bps": 9e11, "latency_s": 1e-6, "size": s} for s in sizes]
            + [{"bandwidth_Bps": 1e11, "latency_s": 1e-6}])


@pytest.mark.parametrize("config, words", [
    (config_with(settings=None), "settings must be an object"),
    (config_with(l2_bytes=10**400), "l2_bytes must be a finite number > 0"),
    (config_with(settings={"depth_exp": 50}), "depth_coef and depth_exp must be small enough"),
    (config_with(settings={"schedules": 5}), "settings.schedules must be a JSON list"),
    (config_with(network_levels=levels(*[2] * 8)), "network_levels must be at most 8 levels"),
    (config_with(network_levels=levels(*[2] * 7)), "at most 5000 placements"),
    (config_with(network_levels=levels(2**40)), "network_levels[0].size must be an integer in"),
    (config_with(max_clock_Hz=1e-300, flop_per_clock_per_thread={"16": 1e-300}),
     "peak FLOP/s is a finite number > 0"),
    (config_with(settings={"tokens_per_param": 1e300}), "tokens_per_param must be small enough"),
])
def test_bad_configs_are_named_in_one_line(tmp_path, config, words):
    (tmp_path / "gpu.json").write_text(json.dumps(config))
    rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2 and words in err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("argv", [
    ["--preset", "H100 SXM", "--months", "1e-9"],
    ["--preset", "H100 SXM", "--threshold", "1e-12"],
    ["--config", "gpu.json"],  # hbm_bytes 1e-300: no model fits anywhere
])
def test_no_feasible_point_is_a_result(tmp_path, argv):
    (tmp_path / "gpu.json").write_text(json.dumps(config_with(hbm_bytes=1e-300)))
    rc, out, err = run_in_process([*argv, "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 0
    if "--threshold" not in argv:
        assert "no cluster finishes in time" in out
        (conf,) = strict_json((tmp_path / "out.json").read_text())["configurations"]
        assert conf["largest_feasible_flop"] is None


@pytest.mark.parametrize("target, words", [
    ("missing/out.json", "does not exist"),
    (".", "is a folder"),
    ("gpu.json", "is the --config file"),
    ("./sub/../gpu.json", "is the --config file"),
    ("/proc/out.json", "cannot create files in folder"),
])
def test_bad_output_paths_are_refused_before_computing(tmp_path, target, words):
    (tmp_path / "sub").mkdir()
    original = json.dumps(config_with())
    (tmp_path / "gpu.json").write_text(original)
    with mock.patch.object(cli, "run_curve", side_effect=AssertionError("computed")):
        rc, _, err = run_in_process(["--config", "gpu.json", "--json", target], tmp_path)
    assert rc == 2 and words in err and len(err.splitlines()) == 1
    assert (tmp_path / "gpu.json").read_text() == original


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only file")
def test_an_unwritable_output_file_is_refused(tmp_path):
    (tmp_path / "out.json").write_text("old")
    (tmp_path / "out.json").chmod(0o444)
    rc, _, err = run_in_process(["--preset", "GTX 580", "--json", "out.json"], tmp_path)
    assert rc == 2 and "is not writable" in err
    assert (tmp_path / "out.json").read_text() == "old"


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    (tmp_path / "out.json").write_text("old")
    with mock.patch.object(cli.os, "replace", side_effect=OSError(28, "No space left on device")):
        rc, _, err = run_in_process(["--preset", "GTX 580", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2 and "No space left on device" in err
    assert (tmp_path / "out.json").read_text() == "old"


# -- real processes ---------------------------------------------------------------------------------

def shell(*args, cwd):
    return subprocess.run([sys.executable, "-m", "helpers.simulator", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_subprocess_no_feasible_point_exits_0_with_valid_json(tmp_path):
    r = shell("--preset", "H100 SXM", "--months", "1e-9", "--json", "out.json", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == ""
    assert "no cluster finishes in time" in r.stdout
    strict_json((tmp_path / "out.json").read_text())


def test_subprocess_six_gpu_nodes_give_a_result(tmp_path):
    (tmp_path / "gpu.json").write_text(json.dumps(config_with(network_levels=levels(6))))
    r = shell("--config", "gpu.json", "--json", "out.json", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    strict_json((tmp_path / "out.json").read_text())


@pytest.mark.parametrize("args, words", [
    (["--config", "gpu.json", "--json", "gpu.json"], "is the --config file"),
    (["--preset", "H100 SXM", "--json", "nowhere/out.json"], "does not exist"),
    (["--preset", "H100 SXM", "--months", "nan", "--json", "out.json"], "months must be"),
    (["--preset", "H100 SXM", "--json"], "expected one argument"),
])
def test_subprocess_bad_input_is_one_line_with_status_2(tmp_path, args, words):
    (tmp_path / "gpu.json").write_text(json.dumps(config_with(settings=None)
                                                  if "--months" in args else config_with()))
    before = (tmp_path / "gpu.json").read_text()
    r = shell(*args, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(PREFIX) and words in r.stderr
    assert (tmp_path / "gpu.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json"]
