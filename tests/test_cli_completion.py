"""``abstractruntime-mlx completion bash|zsh``: a script built from the parser, run by a real
bash; printing it imports neither the host nor MLX nor the server nor the database. And
``--json`` on every read command."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from abstractruntime_mlx.cli.completion_cmd import command_words
from abstractruntime_mlx.cli.main import build_parser, main
from test_cli_startup import DATABASE, HOST_AND_MLX, SERVER, imported_by


def _script(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def _complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of ``words`` (the word being typed), with ``script`` loaded."""
    quoted = " ".join(f"'{w}'" for w in words)
    program = (
        f"{script}\nCOMP_WORDS=(abstractruntime-mlx {quoted}); COMP_CWORD={len(words)}; "
        '_abstractruntime_mlx; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=30, cwd="/")
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completes_commands_subcommands_options_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    script = _script("bash", capsys)
    assert script.rstrip().endswith("complete -o filenames -F _abstractruntime_mlx abstractruntime-mlx")
    assert _complete(script, "ru") == ["run", "runs"]
    assert _complete(script, "runs", "") == sorted(command_words(build_parser())["runs"])
    assert _complete(script, "runs", "show", "1a2b", "--j") == ["--json"]
    assert _complete(script, "runs", "list", "--status", "interrupted", "--fl") == ["--flat"]
    assert _complete(script, "completion", "z") == ["zsh"]
    assert "/bin" in _complete(script, "run", "/bi")  # a path: file names


def test_zsh_script_loads_the_same_function_through_bashcompinit(capsys: pytest.CaptureFixture[str]) -> None:
    bash, zsh = _script("bash", capsys), _script("zsh", capsys)
    assert "autoload -U +X bashcompinit && bashcompinit" in zsh
    assert bash.split("\n", 1)[1] in zsh  # the same function and complete line
    with pytest.raises(SystemExit) as refused:  # argparse refuses the choice: a usage error
        main(["completion", "fish"])
    assert refused.value.code == 2 and "invalid choice: 'fish'" in capsys.readouterr().err


def test_every_command_is_in_the_table() -> None:
    table = command_words(build_parser())
    for path in (
        "run",
        "runs list",
        "runs show",
        "runs resume",
        "runs web",
        "check",
        "ledger status",
        "completion",
        "models path",
    ):
        assert path in table, path
    assert "--json" in table["runs show"] and "bash" in table["completion"]


def test_printing_the_script_imports_neither_host_nor_server_nor_database() -> None:
    assert imported_by(["completion", "bash"], HOST_AND_MLX + SERVER + DATABASE) == []


def test_read_commands_take_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], policy_file: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    assert main(["models", "path", str(model), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"name": str(model), "path": str(model)}
    assert main(["config", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(policy_file)
    read_commands = (
        "runs list",
        "runs show",
        "runs replay",
        "ledger status",
        "check",
        "models list",
        "config show",
        "capabilities",
        "models path",
    )
    table = command_words(build_parser())
    assert [c for c in read_commands if "--json" not in table[c]] == []
