"""Every command the README and the docs show parses, and every configuration they show is
valid: a reader can paste them.

The shell blocks (```bash) are split into commands as a shell would (continuations, `&&`,
`|`, `;`, comments, `NAME=value` lines kept for `$NAME`), then each command is checked by
what runs it: `afd ...` by the `afd` parser; `vllm serve ...`, `python -m
afd_plugin.vllm_serve ...` and `python -m vllm.entrypoints.openai.api_server ...` by vLLM's
own parser, with the `afd` part of `--additional-config` through the AFD config parser;
`python benchmarks/X.py ...` by the flags that script's `--help` lists; a script or file of
this repository by its existence; anything else must be a known tool (a misspelt command
fails). TOML blocks that hold a deployment spec are checked as `afd launch` checks one.

A page runs as written when copied: every `$NAME` a shell block uses is assigned on the
same page, in that block or an earlier one (`NAME=value`, `export NAME=value`), unless a
shell always has it (`$HOME`); and no two servers of one block listen on the same port."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(REPO.glob("packages/*/README.md")),
    REPO / "docker" / "README.md",
]
SHELL = ("bash", "sh", "shell", "console")
# commands the docs may show without this test parsing them (other projects' tools)
KNOWN_TOOLS = {
    "pip", "uv", "git", "curl", "kubectl", "ray", "export", "cd", "cat", "printf", "echo",
    "ip", "ss", "docker", "helm", "source", "ls", "mkdir", "cp", "rm", "kill", "nvidia-smi",
    "npu-smi", "sudo", "env", "timeout", "python3", "python", "pytest", "ruff", "lint-imports",
    "duplicates", "watch", "jq", "head", "tail", "grep", "ping", "nc", "tar", "sha256sum",
    "openssl", "chmod", "systemctl", "ssh", "wget", "unset", "true", "sleep", "set", "mv",
}  # fmt: skip
# variables every shell has: a page need not define these
ENVIRONMENT = {"HOME", "PATH", "PWD", "USER"}
OPERATORS = {"&&", "||", "|", ";", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>>", "&>", ">&", "2>&1"}


def blocks(path: Path, langs: tuple[str, ...]) -> list[tuple[int, str]]:
    """(first line number, text) of each fenced block in one of `langs`."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        if m.group(1) in langs:
            out.append((i + 2, "\n".join(lines[i + 1 : j])))
        i = j + 1
    return out


def shell_commands(
    text: str, names: dict[str, str] | None = None, undefined: list[str] | None = None
) -> list[list[str]]:
    """The block's simple commands, as argv lists, with $NAME expanded from the
    assignments in `names` (the page's so far; the block's own are added to it) and other
    variables standing for a value, X. Each variable used but never assigned is appended
    to `undefined`."""
    names = {} if names is None else names
    commands: list[list[str]] = []

    def flush(argv: list[str]) -> None:
        while argv and re.fullmatch(r"\w+=.*", argv[0]):  # VAR=value [command]
            name, value = argv[0].split("=", 1)
            if len(argv) == 1:
                names[name] = value
            argv = argv[1:]
        if argv[:1] == ["export"]:  # export NAME=value ...
            for word in argv[1:]:
                if re.fullmatch(r"\w+=.*", word):
                    name, value = word.split("=", 1)
                    names[name] = value
        if argv:
            commands.append(argv)

    pending = ""
    for line in text.replace("\\\n", " ").splitlines():

        def expand(m: re.Match) -> str:
            # the value as the shell substitutes it: its quotes are characters, not quoting
            name = m.group(1) or m.group(2)
            if name not in names and name not in ENVIRONMENT and undefined is not None:
                undefined.append(name)
            value = names.get(name, "X")
            return value.replace("\\", "\\\\").replace('"', '\\"')

        for inner in re.findall(r"\$\(([^()]*)\)", line):  # $(command): checked as well
            flush(shlex.split(inner, comments=True))
        line = re.sub(r"\$\(([^()]*)\)", "X", line)
        line = pending + re.sub(r"\$\{(\w+)\}|\$(\w+)", expand, line)
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lex.whitespace_split = True
        lex.commenters = "#"
        argv: list[str] = []
        try:
            tokens = list(lex)
        except ValueError:  # a quote open across lines (a JSON config): read on
            pending = line + "\n"
            continue
        pending = ""
        k = 0
        while k < len(tokens):
            t = tokens[k]
            if t in OPERATORS:
                flush(argv)
                argv = []
            elif t in REDIRECTS or t.rstrip("0123456789") in (">", ">>"):
                k += 1  # the redirection's target
            elif t.isdigit() and k + 1 < len(tokens) and tokens[k + 1] in REDIRECTS:
                pass  # a file descriptor: `2>` arrives as "2" and ">"
            else:
                argv.append(t)
            k += 1
        flush(argv)
    assert not pending, f"a quote is never closed: {pending[:200]!r}"
    return commands


def _unwrap(argv: list[str]) -> list[str]:
    """The command a wrapper runs: `uv run [--no-sync ...] CMD`, `timeout N CMD`, `sudo`,
    `env [VAR=value ...] CMD`."""
    while len(argv) > 1:
        if argv[:2] == ["uv", "run"]:
            argv = argv[2:]
            while argv and argv[0].startswith("-"):
                argv = argv[1:]
        elif argv[0] in ("sudo", "env") or re.fullmatch(r"\w+=.*", argv[0]):
            argv = argv[1:]
        elif argv[0] == "timeout" and len(argv) > 2:
            argv = argv[2:]
        else:
            break
    assert argv, "a wrapper without a command"
    return argv


@cache
def _afd_parser():
    from afd_plugin.cli import build_parser

    return build_parser()


@cache
def _vllm_parsers():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(serve.add_subparsers(dest="subparser"))
    return serve, make_arg_parser(FlexibleArgumentParser(prog="api_server"))


@cache
def _script_flags(script: str) -> frozenset[str]:
    r = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0, f"{script} --help: {r.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", r.stdout))


def _parse(parser, argv: list[str]):
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("--version" in argv or "--help" in argv):
            return None
        raise AssertionError(f"does not parse (exit {exc.code})") from None


def _check_vllm_args(args) -> str:
    from afd_core.config import parse_afd_config

    if args is None:
        return "vllm --help"
    extra = args.additional_config
    if isinstance(extra, str):
        extra = json.loads(extra)
    if extra and "afd" in extra:
        parse_afd_config(extra["afd"], device_type="cpu")
        return "vllm + afd config"
    return "vllm"


def check_command(argv: list[str]) -> str:
    """What checked `argv`; an AssertionError (or the parser's error) if it is wrong."""
    argv = _unwrap(argv)
    exe = Path(argv[0]).name
    if argv[0] == "..." or argv[0].startswith("--"):  # flags to add to a `vllm serve` line
        flags = argv[1:] if argv[0] == "..." else argv
        return _check_vllm_args(_parse(_vllm_parsers()[0], ["serve", "X", *flags]))
    if exe == "afd":
        args = _parse(_afd_parser(), argv[1:])
        if args is None:
            return "afd --version"
        for path in argv[2:]:  # a spec of this repository: it exists and is valid
            if path.startswith("examples/"):
                from afd_plugin.deploy.spec import load_spec

                load_spec(REPO / path)
        return f"afd {args.command}"
    if exe == "vllm":
        assert argv[1] == "serve", argv
        return _check_vllm_args(_parse(_vllm_parsers()[0], argv[1:]))
    if exe.startswith("python") and argv[1:2] == ["-m"]:
        module = argv[2]
        if module == "afd_plugin.vllm_serve":
            return _check_vllm_args(_parse(_vllm_parsers()[0], ["serve", *argv[3:]]))
        if module == "vllm.entrypoints.openai.api_server":
            return _check_vllm_args(_parse(_vllm_parsers()[1], argv[3:]))
        if module == "afd_plugin.cli":
            return check_command(["afd", *argv[3:]])
        if module.split(".")[0] in ("afd_core", "afd_models", "afd_npu", "afd_plugin"):
            import importlib.util

            assert importlib.util.find_spec(module), f"no module {module}"
            return f"python -m {module}"
        assert module in ("pytest", "pip", "venv", "ray"), f"python -m {module}"
        return f"python -m {module}"
    if exe.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
        script = argv[1]
        assert (REPO / script).is_file(), f"{script} is not in this repository"
        if script.startswith("benchmarks/"):
            flags = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("-")}
            unknown = flags - _script_flags(script)
            assert not unknown, f"{script} has no {sorted(unknown)}"
        return script
    if "/" in argv[0] or argv[0] == "bash":
        path = argv[1] if argv[0] == "bash" else argv[0]
        if path.startswith(("./", "scripts/", "tools/", "tests/", ".ci/")):
            assert (REPO / path).is_file(), f"{path} is not in this repository"
            return path
        if argv[0] == "bash":
            return "bash"
    assert exe in KNOWN_TOOLS or argv[0].endswith("/afd"), f"unknown command {argv[0]!r}"
    return exe


def page_blocks(path: Path) -> list[tuple[int, list[list[str]], list[str]]]:
    """(first line, commands, variables used but not assigned so far on the page) of each
    shell block of a page, read in order as a reader pastes them."""
    names: dict[str, str] = {}
    out = []
    for line, text in blocks(path, SHELL):
        undefined: list[str] = []
        out.append((line, shell_commands(text, names, undefined), undefined))
    return out


SERVERS = ("afd_plugin.vllm_serve", "vllm.entrypoints.openai.api_server")


def api_ports(commands: list[list[str]]) -> list[str]:
    """The API port of each server the commands start (vLLM's default 8000 without
    --port); a headless server has none."""
    ports = []
    for argv in commands:
        argv = _unwrap(argv)
        module = argv[2] if argv[1:2] == ["-m"] and len(argv) > 2 else None
        is_server = argv[:2] == ["vllm", "serve"] or (
            Path(argv[0]).name.startswith("python") and module in SERVERS
        )
        if not is_server or "--headless" in argv:
            continue
        port = "8000"
        for i, word in enumerate(argv):
            if word == "--port" and i + 1 < len(argv):
                port = argv[i + 1]
            elif word.startswith("--port="):
                port = word.split("=", 1)[1]
        ports.append(port)
    return ports


def _examples() -> list[tuple[str, list[str]]]:
    out = []
    for path in DOCS:
        for line, commands, _ in page_blocks(path):
            for argv in commands:
                out.append((f"{path.relative_to(REPO)}:{line}", argv))
    return out


EXAMPLES = _examples()


def test_every_variable_is_defined_on_its_page():
    """A `$NAME` nobody assigned on the page expands to nothing when pasted."""
    missing = [
        f"{path.relative_to(REPO)}:{line}: ${name}"
        for path in DOCS
        for line, _, undefined in page_blocks(path)
        for name in dict.fromkeys(undefined)
    ]
    assert not missing, "variables used but never assigned on their page:\n" + "\n".join(missing)


def test_no_two_servers_of_a_block_share_a_port():
    """Servers shown together run together: the second one on the same port would stop
    with `Address already in use`."""
    clashes = []
    for path in DOCS:
        for line, commands, _ in page_blocks(path):
            ports = api_ports(commands)
            taken = sorted({p for p in ports if ports.count(p) > 1})
            if taken:
                clashes.append(f"{path.relative_to(REPO)}:{line}: port {taken}")
    assert not clashes, "servers of one block on the same API port:\n" + "\n".join(clashes)


def test_the_docs_show_commands():
    """The extraction finds the README's quick start and the docs' commands."""
    shown = {" ".join(argv) for _, argv in EXAMPLES}
    assert "./scripts/demo" in shown and "./scripts/test" in shown
    assert sum(1 for _, argv in EXAMPLES if Path(_unwrap(argv)[0]).name == "afd") >= 10
    assert any("--additional-config" in argv for _, argv in EXAMPLES)


@pytest.mark.vllm  # vLLM's own parser checks the `vllm serve` lines
@pytest.mark.parametrize(
    "where, argv", EXAMPLES, ids=[f"{w}:{' '.join(a)[:60]}" for w, a in EXAMPLES]
)
def test_every_command_in_the_docs_parses(where, argv):
    try:
        check_command(argv)
    except Exception as exc:  # noqa: BLE001 - any failure is the doc's
        raise AssertionError(f"{where}: {shlex.join(argv)}\n  {exc}") from exc


def _spec_blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for line, text in blocks(path, ("toml",)):
            out.append((f"{path.relative_to(REPO)}:{line}", text))
    return out


@pytest.mark.parametrize("where, text", _spec_blocks(), ids=lambda v: str(v)[:40])
def test_every_deployment_spec_in_the_docs_is_valid(where, text):
    from afd_plugin.deploy.spec import check_spec

    raw = tomllib.loads(text)
    if "servers" in raw or "hosts" in raw:
        check_spec(raw)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_in_the_docs_resolves():
    """Links between the docs and to files of this repository point at something, and a
    `#anchor` at a heading of its file."""
    pages = [*DOCS, REPO / "SECURITY.md", REPO / "CHANGELOG.md", REPO / "benchmarks/README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_extraction_reads_commands_as_a_shell_does():
    block = (
        'A=\'"role": "ffn"\'   # a comment\n'
        'X=1 vllm serve $M --port 8100 \\\n  --additional-config "{\\"afd\\": {$A}}" > log 2>&1 &\n'
        "M=$(python -m afd_models.tiny qwen3_moe) && afd plan --model x --json | head -1\n"
        "curl -s localhost:8000/metrics\n"
    )
    assert shell_commands(block) == [
        ["vllm", "serve", "X", "--port", "8100", "--additional-config", '{"afd": {"role": "ffn"}}'],
        ["python", "-m", "afd_models.tiny", "qwen3_moe"],
        ["afd", "plan", "--model", "x", "--json"],
        ["head", "-1"],
        ["curl", "-s", "localhost:8000/metrics"],
    ]


def test_an_undefined_variable_and_a_shared_port_are_found():
    """What the two checks above catch, shown on a block of each kind."""
    names: dict[str, str] = {}
    undefined: list[str] = []
    shell_commands("M=/models/m\nvllm serve $M --port $PORT\necho $HOME", names, undefined)
    assert undefined == ["PORT"] and names == {"M": "/models/m"}
    later: list[str] = []  # a later block of the same page sees the page's assignments
    shell_commands("export AFD=x N=2\nvllm serve $M $AFD $N", names, later)
    assert later == []
    two = shell_commands(
        "CUDA_VISIBLE_DEVICES=0 vllm serve m --additional-config '{}'\n"
        "CUDA_VISIBLE_DEVICES=1 vllm serve m --port=8000\n"
        "vllm serve m --port 8100\nvllm serve m --headless\n"
        "python -m afd_plugin.vllm_serve m --port 8100"
    )
    assert api_ports(two) == ["8000", "8000", "8100", "8100"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "command, error",
    [
        ("afd plan --modle x", "does not parse"),
        ("afd launch examples/no-such.toml --print", "No such file"),
        ("vllm serve m --tensor-paralel-size 2", "does not parse"),
        (
            'vllm serve m --additional-config \'{"afd": {"role": "ffn", "num_attn_ranks": 2}}\'',
            "unknown key 'num_attn_ranks'",
        ),
        ("python benchmarks/tpot.py --no-such-flag", "has no ['--no-such-flag']"),
        ("./scripts/no-such-script", "is not in this repository"),
        ("afdd doctor", "unknown command 'afdd'"),
    ],
)
def test_a_wrong_command_in_the_docs_fails(command, error):
    with pytest.raises(Exception, match=re.escape(error)):
        check_command(shlex.split(command))
