"""docs/reference/cli.md's flag tables are generated from the argparse parser and kept equal.

Each table sits between ``<!-- BEGIN generated: smgd X -->`` and ``<!-- END generated -->``.
After changing a flag, rewrite them with ``python -m tests.test_cli_docs``; the test below
fails while the doc and the parser differ, and names a command whose table is missing.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from smgd.cli import build_parser

CLI_MD = Path(__file__).resolve().parent.parent / "docs/reference/cli.md"
SECTION = re.compile(
    r"(<!-- BEGIN generated: (?P<name>[^>]*?) -->\n)(?P<body>.*?)(<!-- END generated -->)", re.S
)
CONFIG_SECTION = "smgd (config flags)"
CONFIG_ANCHOR = "#config-flags-shared-by-serve-check-config-status-reload"


def _is_config_flag(action: argparse.Action) -> bool:
    return action.dest.startswith("cfg:") or action.dest in ("config", "set")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _names(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    return f"`{action.metavar or action.dest.upper()}`"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else None)
    return f"`{metavar}`" if metavar else ""


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is False or value == [] or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return f"`{value}`"


def _table(actions: list[argparse.Action], extra_rows: list[str] | None = None) -> str:
    lines = ["| flag | value | default | meaning |", "|---|---|---|---|"]
    for action in actions:
        if isinstance(action, argparse._HelpAction):
            continue
        meaning = _cell(action.help or "")
        if action.required and action.option_strings:
            meaning = f"required; {meaning}" if meaning else "required"
        cells = [_names(action), _value(action), _default(action), meaning]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, *(extra_rows or [])]) + "\n"


def render() -> dict[str, str]:
    """The body of every generated section, by section name."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = ["| command | what it does |", "|---|---|"]
    commands += [f"| `smgd {a.dest}` | {_cell(a.help or '')} |" for a in sub._choices_actions]
    sections = {
        "smgd": _table([a for a in parser._actions if a is not sub])
        + "\n"
        + "\n".join(commands)
        + "\n"
    }
    for name, command in sub.choices.items():
        own = [a for a in command._actions if not _is_config_flag(a)]
        config = [a for a in command._actions if _is_config_flag(a)]
        extra: list[str] = []
        if config:
            extra = [
                f"| [config flags]({CONFIG_ANCHOR}) | | | `--config`, `--set`, `--server-*`, … |"
            ]
            sections.setdefault(CONFIG_SECTION, _table(config))
            if _table(config) != sections[CONFIG_SECTION]:
                # Not the shared set: give this command its own full table.
                own, extra = command._actions, []
        sections[f"smgd {name}"] = _table(own, extra)
    return sections


def rewrite(text: str, sections: dict[str, str]) -> str:
    def fill(match: re.Match[str]) -> str:
        body = sections.get(match["name"], match["body"])
        return match.group(1) + body + match.group(4)

    return SECTION.sub(fill, text)


def test_cli_md_matches_the_parser() -> None:
    text = CLI_MD.read_text()
    documented = {m["name"]: m["body"] for m in SECTION.finditer(text)}
    expected = render()
    missing = sorted(set(expected) - set(documented))
    assert not missing, f"cli.md has no generated table for {missing}: add the markers"
    stale = sorted(set(documented) - set(expected))
    assert not stale, f"cli.md documents {stale}, which the parser no longer has"
    differ = sorted(name for name in expected if documented[name] != expected[name])
    assert not differ, f"cli.md is out of date for {differ}: run python -m tests.test_cli_docs"


def test_every_flag_of_every_command_is_in_the_tables() -> None:
    # Independent of the renderer: each option string appears in the doc.
    text = CLI_MD.read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert f"`smgd {name}`" in text
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in text, f"smgd {name} {option} is not in cli.md"


def test_rewrite_replaces_only_the_generated_part() -> None:
    text = "intro\n<!-- BEGIN generated: smgd -->\nold\n<!-- END generated -->\nafter\n"
    assert rewrite(text, {"smgd": "new\n"}) == (
        "intro\n<!-- BEGIN generated: smgd -->\nnew\n<!-- END generated -->\nafter\n"
    )


if __name__ == "__main__":
    CLI_MD.write_text(rewrite(CLI_MD.read_text(), render()))
    print(f"rewrote the generated tables of {CLI_MD}")
