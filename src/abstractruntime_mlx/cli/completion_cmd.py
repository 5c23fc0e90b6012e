"""``abstractruntime-mlx completion bash|zsh``: a shell completion script, printed.

    eval "$(abstractruntime-mlx completion bash)"      # in ~/.bashrc
    eval "$(abstractruntime-mlx completion zsh)"       # in ~/.zshrc

The script is built from the command's own argparse parser when it is printed: every command,
subcommand, option and choice the installed version has, nothing to keep in step by hand. It
completes words from that table alone (no Python runs at TAB time); file names are completed
where a command takes a path. zsh uses the same function through zsh's ``bashcompinit``.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Final

SHELLS: Final = ("bash", "zsh")
PROGRAM: Final = "abstractruntime-mlx"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "completion",
        help="print a bash or zsh completion script",
        description='Print a completion script for SHELL; load it with eval "$(abstractruntime-mlx completion bash)".',
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    parser.set_defaults(handler=_completion)


def _completion(args: argparse.Namespace) -> int:
    from .main import build_parser

    print(completion_script(build_parser(), args.shell))
    return 0


def command_words(parser: argparse.ArgumentParser, path: str = "") -> dict[str, list[str]]:
    """``"runs show" -> ["--events", "--json", "--ledger", ...]``: for the command at each path
    (``""`` the program itself), the words that may follow it: its subcommands, its options and
    the choices of its positional arguments."""
    words: list[str] = []
    out: dict[str, list[str]] = {path: words}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words.append(name)
                out.update(command_words(sub, f"{path} {name}".strip()))
        elif action.option_strings:
            words.extend(o for o in action.option_strings if o.startswith("--") or len(action.option_strings) == 1)
        elif action.choices is not None:
            words.extend(str(c) for c in action.choices)
    return out


def _pattern(path: str) -> str:
    """``path`` as a ``case`` pattern (``""`` for the program itself)."""
    return shlex.quote(path) if path else '""'


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for ``shell`` (``bash`` or ``zsh``) of ``parser``'s commands."""
    if shell not in SHELLS:
        raise ValueError(f"shell must be one of {', '.join(SHELLS)} (got {shell!r})")
    table = command_words(parser)
    cases = "\n".join(
        f"        {_pattern(path)}) words={shlex.quote(' '.join(sorted(set(words))))} ;;"
        for path, words in sorted(table.items())
    )
    paths = " ".join(shlex.quote(p) for p in sorted(table) if p)
    function = f"""_abstractruntime_mlx() {{
    local cur path candidate words i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    path=""
    # The longest command path (e.g. "runs show") among the words before the cursor.
    for ((i = 1; i < COMP_CWORD; i++)); do
        candidate="${{path:+$path }}${{COMP_WORDS[i]}}"
        for known in {paths}; do
            if [[ "$known" == "$candidate" ]]; then path="$candidate"; break; fi
        done
    done
    case "$path" in
{cases}
        *) words="" ;;
    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
    if [[ ${{#COMPREPLY[@]}} -eq 0 && "$cur" != -* ]]; then
        COMPREPLY=($(compgen -f -- "$cur"))  # a flow file, a ledger path, a model folder
    fi
}}
complete -o filenames -F _abstractruntime_mlx {PROGRAM}"""
    if shell == "zsh":
        return (
            f"# {PROGRAM} completion for zsh (through bashcompinit)\nautoload "
            f"-U +X bashcompinit && bashcompinit\n{function}"
        )
    return f"# {PROGRAM} completion for bash\n{function}"
