"""The simulator's command line, tried adversarially: every input ends in "exit 0 with a valid
JSON file" or "exit 2 with one line naming the field", never a traceback, never a partial
file. Hypothesis throws generated command lines and configurations at `main(argv)` in-process
(fast); a few real subprocess runs check what a shell sees."""
import contextlib
import functools
import io
import json
import os
import socket
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
from helpers.simulator.config import MAX_CONFIG_BYTES, gpu_to_json
from helpers.simulator.curve import run_curve
from helpers.simulator.report import dumps

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "python -m helpers.simulator: error: "


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def run_in_process(argv: list[str], folder: Path,
                   encoding: str = "utf-8") -> tuple[int, str, str]:
    """`main(argv)` run in `folder`, with only the first grid points computed (the search
    code is the same; the full curve is what the subprocess tests run). stdout and stderr
    encode strictly in `encoding`, as a terminal's would under PYTHONIOENCODING."""
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict",
                                 write_through=True) for _ in range(2))
    # (A test that mocked run_curve keeps its mock.)
    quick = cli.run_curve if isinstance(cli.run_curve, mock.Mock) else \
        functools.partial(run_curve, max_compute=3e25)
    with mock.patch.object(cli, "run_curve", quick), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), _cwd(folder):
        rc = cli.main(argv)
    return rc, *(s.buffer.getvalue().decode(encoding) for s in (out, err))


@contextlib.contextmanager
def _cwd(folder):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def check_outcome(rc: int, err: str, folder: Path, target: str = "out.json",
                  longest: int = len(PREFIX) + cli.MAX_MESSAGE) -> None:
    """The contract: a result, or one line of bounded length naming what is wrong; nothing
    half-written."""
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
        assert len(lines[0]) <= longest, len(lines[0])
        assert "Traceback" not in err


@contextlib.contextmanager
def any_int_digits():
    """Let json.dumps write integers of more than 4300 digits (as another program could)."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


# -- generated inputs ---------------------------------------------------------------------------

# Numbers at the edges of what JSON holds: NaN and ±Infinity (Python's json reads them),
# subnormals, integers a float cannot hold (10**400) and integers Python will not even
# parse by default (more than 4300 digits).
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=1e-12, max_value=1e12),
    st.integers(min_value=-2, max_value=10**30), st.just(10**400),
    st.integers(min_value=-10**5000, max_value=10**5000),
    st.sampled_from([0, 1, 2, 6, 8, 1e-300, 5e-324, 1e300, 2**53 + 1, 2**1024, 10**4300 - 1,
                     10**4300, -10**5000]))
# Text at the edges: lone surrogates, control and terminal escape characters, line breaks
# other than "\n", private-use and symbols an ASCII terminal cannot show, long names.
edge_text = st.one_of(
    st.text(st.characters(categories=["Cs", "Cc", "Zl", "Zp", "Co", "So", "Lo", "Mn"]),
            max_size=20),
    st.text(max_size=5),
    st.sampled_from(["\udc80", "\ud800x", "\x1b[2J", "é" * 300, "a\u2028b\rc", "\x00",
                     "x" * 10**4]))
junk = st.one_of(st.none(), st.booleans(), edge_text, st.lists(st.integers(), max_size=2),
                 st.dictionaries(edge_text, st.integers(), max_size=2))
values = st.one_of(numbers, junk)
flag_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["3", "0", "-1", "1e-9", "1e-12", "nan", "inf", "1e400", "0.8", "x", "",
                     "1" + "0" * 5000, "-" + "9" * 5000, "0x10", "1_000", "\udc80", "é" * 300]))

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
    if draw(st.booleans()):
        data["name"] = draw(edge_text)
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
@given(preset=st.one_of(st.sampled_from(sorted(PRESETS)), edge_text), extra=flags())
def test_any_command_line_gives_a_result_or_one_line(preset, extra):
    with tempfile.TemporaryDirectory() as d:
        rc, _, err = run_in_process(["--preset", preset, "--json", "out.json", "--quiet", *extra],
                                    Path(d))
        check_outcome(rc, err, Path(d))


@FAST
@given(config=configs(), extra=flags())
def test_any_config_file_gives_a_result_or_one_line(config, extra):
    with tempfile.TemporaryDirectory() as d, any_int_digits():
        text = json.dumps(config)  # NaN and Infinity as Python's json writes them
        (Path(d) / "gpu.json").write_text(text, errors="surrogatepass")
        rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json", "--quiet",
                                     *extra], Path(d))
        check_outcome(rc, err, Path(d))
        # the input is never touched
        assert (Path(d) / "gpu.json").read_text(errors="surrogatepass") == text


@FAST
@given(name=edge_text, gpu=st.sampled_from(sorted(PRESETS)))
def test_any_name_prints_on_an_ascii_terminal(name, gpu):
    # The summary holds the GPU's name: an ASCII stdout must take it, whatever it is.
    with tempfile.TemporaryDirectory() as d:
        config = gpu_to_json(PRESETS[gpu]) | {"name": name}
        (Path(d) / "gpu.json").write_text(json.dumps(config))
        rc, out, err = run_in_process(["--config", "gpu.json", "--json", "out.json"], Path(d),
                                      encoding="ascii")
        check_outcome(rc, err, Path(d), longest=len(PREFIX) + 10 * cli.MAX_MESSAGE)
        if rc == 0:
            assert len(out.splitlines()) in (1, 4)  # one line per fact, whatever the name holds
            (conf,) = strict_json((Path(d) / "out.json").read_text())["configurations"]
            assert conf["name"] == name


@FAST
@given(name=st.text(st.characters(exclude_characters="/"), min_size=1, max_size=300))
def test_any_output_name_gives_a_result_or_one_line(name):
    # No "/" in `name`: whatever it is, it names something inside the folder.
    with tempfile.TemporaryDirectory() as d:
        rc, _, err = run_in_process(["--preset", "GTX 580", "--json", f"./{name}", "--quiet"],
                                    Path(d))
        check_outcome(rc, err, Path(d), target=name)


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

def shell(*args, cwd, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "helpers.simulator", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          errors="backslashreplace",
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})})


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


# -- what a name on disk holds ---------------------------------------------------------------------

def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


@pytest.mark.parametrize("make, words", [
    (lambda p: p.symlink_to("real.json"), "is a symbolic link"),
    (lambda p: p.symlink_to("/dev/null"), "is a symbolic link"),
    (lambda p: p.symlink_to("nowhere.json"), "is a symbolic link"),
    (lambda p: p.symlink_to(p.parent / "sub"), "is a symbolic link"),
    (os.mkfifo, "is not a regular file"),
    (_socket, "is not a regular file"),
], ids=["link-to-file", "link-to-dev-null", "dangling-link", "link-to-folder", "fifo", "socket"])
def test_json_onto_anything_but_a_regular_file_is_refused(tmp_path, make, words):
    # os.replace would put a regular file in place of the link, pipe or device node (as root,
    # `--json /dev/null` replaced the system's /dev/null): refused, and the name keeps what
    # it held.
    (tmp_path / "sub").mkdir()
    (tmp_path / "real.json").write_text("old")
    target = tmp_path / "out.json"
    make(target)
    before = os.lstat(target)
    with mock.patch.object(cli, "run_curve", side_effect=AssertionError("computed")):
        rc, _, err = run_in_process(["--preset", "GTX 580", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2 and words in err
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert (tmp_path / "real.json").read_text() == "old"


@pytest.mark.parametrize("swap", [lambda p: p.symlink_to("/dev/null"), os.mkfifo],
                         ids=["link-to-dev-null", "fifo"])
def test_a_target_swapped_during_the_computation_is_refused(tmp_path, swap):
    # The curve takes minutes: what the name holds is checked again just before the rename.
    def swapping_dumps(curves):  # called once the curve is computed
        (tmp_path / "out.json").unlink()
        swap(tmp_path / "out.json")
        return dumps(curves)

    (tmp_path / "out.json").write_text("old")
    with mock.patch.object(cli, "dumps", swapping_dumps):
        rc, _, err = run_in_process(["--preset", "GTX 580", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2 and "out.json is" in err
    assert not (tmp_path / "out.json").is_file() or (tmp_path / "out.json").is_symlink()


def test_an_interrupt_is_one_line_and_leaves_no_temporary_file(tmp_path):
    with mock.patch.object(cli, "run_curve", side_effect=KeyboardInterrupt):
        rc, _, err = run_in_process(["--preset", "GTX 580", "--json", "out.json"], tmp_path)
    assert rc == 130 and err == PREFIX + "interrupted\n"
    assert list(tmp_path.iterdir()) == []


# -- what a configuration path holds -------------------------------------------------------------

@pytest.mark.parametrize("make, words", [
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: p.write_bytes(b" " * (MAX_CONFIG_BYTES + 1)), "is larger than 1048576 bytes"),
    (lambda p: p.write_bytes(b"{\"name\": \"\xff\"}"), "is not UTF-8 text"),
    (_socket, "is not a regular file"),
], ids=["folder", "over-the-cap", "not-utf8", "socket"])
def test_a_config_that_is_not_a_small_regular_file_is_refused(tmp_path, make, words):
    make(tmp_path / "gpu.json")
    with mock.patch("builtins.open", side_effect=AssertionError("opened")) \
            if words != "is not UTF-8 text" else contextlib.nullcontext():
        rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2 and words in err


def test_a_config_at_the_size_cap_is_read(tmp_path):
    text = json.dumps(config_with())
    (tmp_path / "gpu.json").write_text(text + " " * (MAX_CONFIG_BYTES - len(text)))
    rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json", "--quiet"],
                                tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 0


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("field", ["name", "num_sms", "settings", "network_levels"])
@pytest.mark.parametrize("depth", [50, 990, 300_000])
def test_deep_nesting_is_one_line(tmp_path, field, depth):
    text = json.dumps(config_with(**{field: "@"})).replace('"@"', _nested(depth))
    (tmp_path / "gpu.json").write_text(text)
    rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2


@pytest.mark.parametrize("field, value, words", [
    ("num_sms", 10**400, "peak FLOP/s is a finite number"),  # an int no float can hold
    ("num_sms", 10**5000, "num_sms must be a positive integer, got inf"),  # past int parsing
    ("bitwidth", 10**5000, "bitwidth must be a positive integer"),
    ("l2_bytes", -10**5000, "l2_bytes must be a finite number > 0, got -inf"),
    ("network_levels", [{"bandwidth_Bps": 1e11, "latency_s": 0, "size": 10**5000},
                        {"bandwidth_Bps": 1e11, "latency_s": 0}], "network_levels[0].size"),
    ("flop_per_clock_per_thread", {"1" * 5000: 1.0}, "keys must be bitwidths"),
    ("settings", {"months": 10**5000}, "months must be a finite number > 0"),
], ids=["num_sms-400digits", "num_sms-5001digits", "bitwidth-5001digits", "l2_bytes-negative",
        "level_size-5001digits", "bitwidth_key-5000digits", "months-5001digits"])
def test_huge_integers_name_their_field(tmp_path, field, value, words):
    with any_int_digits():
        (tmp_path / "gpu.json").write_text(json.dumps(config_with(**{field: value})))
    rc, _, err = run_in_process(["--config", "gpu.json", "--json", "out.json"], tmp_path)
    check_outcome(rc, err, tmp_path)
    assert rc == 2 and words in err


# -- real processes: what only a shell shows ------------------------------------------------------

@pytest.mark.parametrize("config", ["fifo", "/dev/zero"])
def test_subprocess_a_config_that_never_answers_or_never_ends_is_refused(tmp_path, config):
    os.mkfifo(tmp_path / "fifo")  # no writer: reading it would wait forever
    r = shell("--config", config, "--json", "out.json", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "is not a regular file" in r.stderr


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C"}])
def test_subprocess_text_the_terminal_cannot_encode(tmp_path, env):
    (tmp_path / "gpu.json").write_text(json.dumps(config_with(name="GPU \udc80 é ☃ \x1b[2J")))
    r = shell("--config", "gpu.json", "--json", "out.json", cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "GPU \\udc80 " in r.stdout and "\x1b" not in r.stdout
    r = shell("--preset", "H\udcff é \x1b[2J" * 100, "--json", "out.json", cwd=tmp_path, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
