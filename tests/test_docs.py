"""The documentation keeps up with the code: every CLI command and option is in docs/cli.md
(with the usage line `--help` prints), and every relative link in the Markdown resolves."""
import html
import re
from pathlib import Path

import click
import pytest

from packer.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
MARKDOWN = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def cli_sections(text: str) -> dict:
    """``{command name: its section's text}`` from the ``## packer NAME`` headings."""
    parts = re.split(r"^## packer (\S+)[ \t]*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def usage_line(group: click.Group, name: str) -> str:
    """What ``packer NAME --help`` prints after "Usage: "."""
    cmd = group.commands[name]
    ctx = click.Context(cmd, info_name=name, parent=click.Context(group, info_name="packer"))
    return " ".join(["packer", name] + cmd.collect_usage_pieces(ctx))


def option_names(cmd: click.Command) -> list:
    return [o for p in cmd.params if isinstance(p, click.Option)
            for o in p.opts + p.secondary_opts]


def doc_problems(group: click.Group, text: str) -> list:
    """What ``text`` (docs/cli.md) lacks or gets wrong about ``group``'s commands."""
    problems = []
    sections = cli_sections(text)
    for name, cmd in sorted(group.commands.items()):
        if name not in sections:
            problems.append(f"no '## packer {name}' section")
            continue
        section = sections[name]
        usage = usage_line(group, name)
        if usage not in section:
            problems.append(f"'packer {name}': the usage line {usage!r} is missing")
        for o in option_names(cmd):
            if not re.search(rf"`{re.escape(o)}[` ]", section):
                problems.append(f"'packer {name}': option {o} is not documented")
    for name, section in sections.items():
        if name not in group.commands:
            problems.append(f"'packer {name}' is documented but does not exist")
            continue
        real = set(option_names(group.commands[name])) | {"-h", "--help"}
        for row in re.findall(r"^\| *(`-.*?) *\|", section, flags=re.M):  # options table rows
            for opt in re.findall(r"`(-[\w-]+)", row):
                if opt not in real:
                    problems.append(f"'packer {name}': documents {opt}, which it does not have")
    for p in group.params:
        for opt in p.opts:
            if opt.startswith("--") and f"`{opt}" not in text:
                problems.append(f"global option {opt} is not documented")
    return problems


def option_rows(section: str) -> dict:
    """``{option: (default, meaning)}`` from a section's options table (``\\|`` and ``&lt;``
    unescaped)."""
    rows = {}
    for line in section.splitlines():
        cells = [html.unescape(c.strip().replace("\\|", "|"))
                 for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`-"):
            rows.update((o, tuple(cells[1:])) for o in re.findall(r"`(-[\w-]+)", cells[0]))
    return rows


def help_mismatches(group: click.Group, text: str) -> list:
    """Options whose docs/cli.md row says other than ``--help`` (its meaning, its default)."""
    problems, sections = [], cli_sections(text)
    for name, cmd in sorted(group.commands.items()):
        rows = option_rows(sections.get(name, ""))
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.opts[0] not in rows:
                continue  # a missing row is doc_problems' to report
            default, meaning = rows[p.opts[0]]
            if meaning != p.help:
                problems.append(f"'packer {name} {p.opts[0]}': docs say {meaning!r}, "
                                f"--help says {p.help!r}")
            if p.show_default and default != str(p.default):
                problems.append(f"'packer {name} {p.opts[0]}': docs' default {default!r}, "
                                f"--help's {p.default!r}")
    return problems


def test_cli_md_option_rows_say_what_help_says():
    """docs/cli.md promises the same options as `--help`: `merge --json` listed keys without
    the `missing_parts` it prints."""
    problems = help_mismatches(main, CLI_MD.read_text("utf-8"))
    assert not problems, "docs/cli.md differs from --help:\n" + "\n".join(problems)


def test_help_mismatch_checker_reads_escaped_rows():
    @click.group()
    def cli():
        pass

    @cli.command()
    @click.option("--mode", type=click.Choice(["a", "b"]), help="'a' or 'b' <x>.")
    @click.option("--n", default=3, show_default=True, help="How many.")
    def go(mode, n):
        pass

    good = ("## packer go\n| `--mode [a\\|b]` |  | 'a' or 'b' &lt;x&gt;. |\n"
            "| `--n N` | 3 | How many. |\n")
    assert help_mismatches(cli, good) == []
    assert help_mismatches(cli, good.replace("| 3 | How many.", "| 4 | How few.")) == [
        "'packer go --n': docs say 'How few.', --help says 'How many.'",
        "'packer go --n': docs' default '4', --help's 3"]


def test_cli_md_documents_every_command_and_option():
    problems = doc_problems(main, CLI_MD.read_text("utf-8"))
    assert not problems, "docs/cli.md is out of date with `packer --help`:\n" + "\n".join(problems)


def test_doc_checker_catches_missing_and_stale_entries():
    @click.group()
    @click.option("--version", is_flag=True)
    def cli():
        pass

    @cli.command()
    @click.argument("src")
    @click.option("--fast", "-f", is_flag=True)
    @click.option("--level", type=int)
    def go(src, fast, level):
        pass

    @cli.command()
    def stop():
        pass

    good = ("`--version`\n## packer go\n```\npacker go [OPTIONS] SRC\n```\n"
            "| `--fast`, `-f` | |\n| `--level N` | |\n## packer stop\n`packer stop [OPTIONS]`\n")
    assert doc_problems(cli, good) == []
    bad = good.replace("| `--level N` | |", "| `--gone` | |").replace("## packer stop", "## packer halt")
    assert doc_problems(cli, bad) == [
        "'packer go': option --level is not documented",
        "no '## packer stop' section",
        "'packer go': documents --gone, which it does not have",
        "'packer halt' is documented but does not exist",
    ]
    assert doc_problems(cli, good.replace("[OPTIONS] SRC", "SRC")) == [
        "'packer go': the usage line 'packer go [OPTIONS] SRC' is missing"]


def markdown_links(path: Path):
    """Link targets of ``[text](target)`` outside fenced code blocks."""
    text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text("utf-8"), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return re.findall(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(md):
    broken = []
    for target in markdown_links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:...) or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            broken.append(target)
    assert not broken, f"{md.relative_to(ROOT)} links to missing files: {broken}"


def test_link_finder_sees_links_and_skips_code(tmp_path):
    md = tmp_path / "x.md"
    md.write_text('See [a](docs/a.md#part), [b](<b.md>), [t](c.md "title"), [w](https://x.org).\n'
                  "```\n[not](in-code.md)\n```\n`[nor](inline.md)`\n", "utf-8")
    assert markdown_links(md) == ["docs/a.md#part", "b.md", "c.md", "https://x.org"]
