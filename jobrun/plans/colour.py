"""`jobrun print`'s colour: the pseudo-code of :mod:`jobrun.plans.printer` highlighted by rich.

Only the terminal output is coloured; the text itself (and so every test of it) is the
printer's, never re-wrapped or cropped.
"""

from __future__ import annotations

import re

_KEYWORDS = "task|loop|if|elif|else|parallel|branch|report|stop_if|pass|init|do|exit|epoch|download"
_HEADER_KEYS = "job|seed|device|replicas|parallel|fsdp_layers|max_restarts|vars|max_epochs|max_steps|stop_when|early_stop|checkpoint|loggers"

# Applied in order; a later match restyles an earlier one (strings and marks win).
_HIGHLIGHTS = (
    r"(?P<blob>[A-Za-z_][A-Za-z0-9_/]*)",
    r"(?<![\w/.])(?P<number>-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)(?![\w/])",
    r"(?<![\w/])(?P<const>true|false|null)(?![\w/])",
    # A keyword starts a line and is followed by ':' or a word, never by ' =' or ','
    # (which would make it a blob that happens to be called `loop`).
    rf"^[ ]*(?P<keyword>{_KEYWORDS})(?=:|[ ](?![=,])|$)",
    r"^[ ]*loop[ ].*?[ ](?P<keyword>as)[ ]",
    r"^[ ]*loop[ ](?P<keyword>until stop)",
    r"^[ ]*report[ ](?P<keyword>every)[ ](?P<number>[^:\n]*):$",
    r"^epoch[ ]\((?P<keyword>repeat until|repeat forever)",
    r"^[ ]*task[ ]\S+[ ](?P<keyword>@)[ ]",
    r"\][ ](?P<keyword>->[ ]outputs)[ ]\[",
    rf"^(?P<header>{_HEADER_KEYS}):",
    r"(?P<op>[A-Za-z_][A-Za-z0-9_.]*)\(",
    r"(?<![\w+])(?P<argkey>[A-Za-z_][A-Za-z0-9_]*)=",
    r"(?:(?<=\{)|(?<=, ))(?P<argkey>[A-Za-z_][A-Za-z0-9_.\-]*)(?=: )",  # keys of a mapping
    r'(?P<string>"(?:[^"\\\n]|\\.)*?(?:"|(?=\.\.\.<\+len=\d+>)))',
    r"(?P<mark>\.\.\.<\+len=\d+>)",
)

_STYLES = {
    "jobrun.blob": "green",
    "jobrun.number": "bright_blue",
    "jobrun.const": "bright_blue",
    "jobrun.keyword": "bold magenta",
    "jobrun.header": "bold default",
    "jobrun.op": "bold cyan",
    "jobrun.argkey": "italic default",
    "jobrun.string": "yellow",
    "jobrun.mark": "dim red",
}


def print_rich(text: str) -> None:
    """Print `text` with colour (op names, keywords, blob names, literals) via rich.

    Lines are never re-wrapped or cropped: what is printed is exactly `text` plus colour.
    rich decides whether colour is wanted (a terminal, NO_COLOR, FORCE_COLOR).
    """
    from rich.console import Console
    from rich.highlighter import RegexHighlighter
    from rich.text import Text
    from rich.theme import Theme

    class PlanHighlighter(RegexHighlighter):
        base_style = "jobrun."
        highlights = [re.compile(p, re.MULTILINE) for p in _HIGHLIGHTS]

    console = Console(theme=Theme(_STYLES), highlight=False, soft_wrap=True)
    body = Text(text[:-1] if text.endswith("\n") else text, no_wrap=True, overflow="ignore")
    PlanHighlighter().highlight(body)
    console.print(body, soft_wrap=True, crop=False)
