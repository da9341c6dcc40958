"""Check the user documentation: README.md, CONTRIBUTING.md and docs/**/*.md outside docs/experiments/.

::

    python tools/check_docs.py                      # the user docs of this checkout
    python tools/check_docs.py --files a.md b.md    # these files only

Prints one line per problem, ``path:line: what``, and exits 1 if there is any; else one line of summary,
exit 0. The rules (issue 64; docs/experiments/ is the lab notebook and is not checked):

a. No commit hashes: a word of 7 to 40 lowercase hexadecimal characters with at least one digit and one
   letter a-f. Decisions against false positives: a number (``1000000``) has no letter and an English word
   (``deadbeef``, ``facade``) no digit; ``0x1234abcd`` is a literal, not a word (the ``x`` joins it); a word
   joined to letters, digits or ``_`` on either side is part of a longer word (``sha256`` digests are 64
   characters); a float exponent of digits only (``1e100000``) is a number; the word after ``--job-id`` is a
   job id (the launcher's are 16 hexadecimal characters); and URLs (``http://``, ``https://``) are skipped,
   since a link that pins an upstream file at a commit is a citation, not this project's history. Code is
   checked like prose: write ``<commit>`` in an example.
b. No word ``HEAD`` (case-sensitive, whole word; URLs skipped).
c. No run numbers: ``run 14``, ``Runs 21 and 22``, ``run #3``, and no ``predict-N``. A number followed by what
   it counts (``run 2 workers``, ``runs 3 times``: :data:`COUNTED`) is a count, and one joined to a word
   (``runs 1-bit Adam``, ``run 2x``) a compound, not a run number.
d. README.md has at most 200 lines.
e. No paragraph over 15 lines: consecutive non-blank lines outside fenced code, where a table line (starting
   with ``|``) is not part of a paragraph, a list item (``*``, ``-``, ``+`` or ``N.``/``N)`` after optional
   indentation) starts a new one, and a heading, a thematic break or an HTML comment line ends one and counts
   in none.
f. What lies between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` (markers on lines of their own,
   outside fenced code) is written by ``make bench-docs`` and exempt from a-c and e; its last non-blank line
   must be a stamp in the format of :data:`bunsan.bench.report.STAMP_RE` (command, commit, date, machine) for
   the same block. An older stamp is a problem: regenerate the block.
g. Relative links and images, ``[text](path)``, ``[text](path#anchor)`` and ``[label]: path``, resolve to an
   existing file or directory inside the repository, outside fenced code and inline code. Links with a scheme
   (``https:``, ``mailto:``) and pure ``#anchor`` links are not checked, nor are anchors.

Every rule is a pure function of the text (:func:`check_text`); only :func:`main` reads files.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's bunsan; bunsan.bench.report imports no torch

from bunsan.bench.report import STAMP_RE  # noqa: E402

__all__ = ["COUNTED", "check_text", "default_files", "main"]

Problem = tuple[int, str]  # (1-based line, what is wrong)

README_MAX_LINES = 200
PARAGRAPH_MAX_LINES = 15
# Words that make "run N <word>" a count rather than a run number.
# fmt: off
COUNTED = frozenset({
    "batch", "batches", "command", "commands", "copies", "copy", "epoch", "epochs", "gpu", "gpus", "host",
    "hosts", "iteration", "iterations", "job", "jobs", "listener", "listeners", "node", "nodes", "process",
    "processes", "rank", "ranks", "replica", "replicas", "round", "rounds", "seed", "seeds", "step", "steps",
    "test", "tests", "thread", "threads", "time", "times", "trial", "trials", "worker", "workers",
})
# fmt: on

_URL = re.compile(r"https?://[^\s)>\]]+")
_JOB_ID = re.compile(r"--job-id[= ][0-9a-f]+\b")
_HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
_EXPONENT = re.compile(r"[0-9]+e[0-9]+")
_HEAD = re.compile(r"\bHEAD\b")
_RUN = re.compile(r"\b[Rr]uns?\s+#?(\d+(?:[.,\-\u2013]\d+)*)(?![\w\-\u2013])(?:\s+([A-Za-z]+))?")
_PREDICT = re.compile(r"\bpredict-\d+")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_OPEN = re.compile(r"<!-- bench:([A-Za-z0-9_.-]+) -->")
_CLOSE = re.compile(r"<!-- /bench:([A-Za-z0-9_.-]+) -->")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])(?:\s|$)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}(?:\s|$)")
_BREAK = re.compile(r"^\s{0,3}([-=*_])(?:\s*\1){2,}\s*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^\s{0,3}\[(?!\^)[^\]]+\]:\s*<?([^\s>]+)>?")  # not a footnote, [^1]: ...
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def fenced_lines(lines: Sequence[str]) -> set[int]:
    """0-based indices of the lines of fenced code blocks, fences included (an unclosed fence runs to the end)."""
    inside: set[int] = set()
    fence = ""
    for i, line in enumerate(lines):
        if fence:
            inside.add(i)
            if re.fullmatch(re.escape(fence[0]) + f"{{{len(fence)},}}", line.strip()):
                fence = ""
        elif match := _FENCE.match(line):
            fence = match.group(1)
            inside.add(i)
    return inside


def generated_blocks(lines: Sequence[str], fenced: set[int]) -> tuple[set[int], list[Problem]]:
    """Rule f: the 0-based lines of the bench blocks (markers included) and the problems of their markers and stamps."""
    exempt: set[int] = set()
    problems: list[Problem] = []
    i = 0
    while i < len(lines):
        opening, closing = _OPEN.fullmatch(lines[i].strip()), _CLOSE.fullmatch(lines[i].strip())
        if i in fenced or not (opening or closing):
            i += 1
            continue
        if closing:
            problems.append((i + 1, f"closing marker of bench block {closing.group(1)} without its opening marker"))
            i += 1
            continue
        assert opening is not None
        name = opening.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == f"<!-- /bench:{name} -->"), None)
        if end is None:
            problems.append((i + 1, f"bench block {name} has no closing marker <!-- /bench:{name} -->"))
            i += 1
            continue
        exempt.update(range(i, end + 1))
        last = next((j for j in range(end - 1, i, -1) if lines[j].strip()), None)
        line = lines[last].strip() if last is not None else ""
        stamp = STAMP_RE.fullmatch(line)
        where = last + 1 if last is not None else i + 1
        regenerate = f"regenerate it with make bench-docs (python -m bunsan.bench.report --only {name})"
        if stamp and stamp.group("name") != name:
            problems.append((where, f"the stamp of bench block {name} names block {stamp.group('name')}"))
        elif not stamp and line.startswith("<sub>generated by"):
            problems.append((where, f"bench block {name} has a stamp in an old format; {regenerate}"))
        elif not stamp:
            problems.append((where, f"bench block {name} does not end with its stamp line; {regenerate}"))
        i = end + 1
    return exempt, problems


def check_words(lines: Sequence[str], exempt: set[int]) -> list[Problem]:
    """Rules a-c on every line not in ``exempt``, code included; URLs are skipped."""
    problems: list[Problem] = []
    for i, raw in enumerate(lines):
        if i in exempt:
            continue
        line = _JOB_ID.sub(" ", _URL.sub(" ", raw))
        for match in _HASH.finditer(line):
            if not _EXPONENT.fullmatch(match.group()):
                problems.append((i + 1, f"commit hash {match.group()!r}: no commit hashes outside docs/experiments/"))
        problems += [(i + 1, "'HEAD': say which version, or state the rule instead")] * len(_HEAD.findall(line))
        for match in _RUN.finditer(line):
            if (match.group(2) or "").lower() not in COUNTED:
                run = match.group().rsplit(None, 1)[0] if match.group(2) else match.group()
                problems.append((i + 1, f"run number {run!r}: no run numbers outside docs/experiments/"))
        for match in _PREDICT.finditer(line):
            problems.append((i + 1, f"{match.group()!r}: no predict-N labels outside docs/experiments/"))
    return problems


def check_length(path: str, lines: Sequence[str]) -> list[Problem]:
    """Rule d: README.md has at most 200 lines."""
    if Path(path).name == "README.md" and len(lines) > README_MAX_LINES:
        return [(README_MAX_LINES + 1, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}")]
    return []


def paragraphs(lines: Sequence[str], exempt: set[int]) -> list[tuple[int, int]]:
    """(first 0-based line, number of lines) of each paragraph, as rule e counts them; ``exempt`` lines are in none."""
    found: list[tuple[int, int]] = []
    start, count, comment = 0, 0, False
    for i, line in enumerate(lines):
        stripped = line.strip()
        outside = (
            i in exempt or not stripped or stripped.startswith("|") or bool(_HEADING.match(line) or _BREAK.match(line))
        )
        if not outside and (comment or stripped.startswith("<!--")):
            outside, comment = True, "-->" not in stripped
        if count and (outside or _LIST_ITEM.match(line)):
            found.append((start, count))
            count = 0
        if not outside:
            start, count = (i, 1) if count == 0 else (start, count + 1)
    if count:
        found.append((start, count))
    return found


def check_paragraphs(lines: Sequence[str], exempt: set[int]) -> list[Problem]:
    """Rule e: no paragraph over 15 lines."""
    return [
        (start + 1, f"paragraph of {count} lines (at most {PARAGRAPH_MAX_LINES}): split it or make it a list")
        for start, count in paragraphs(lines, exempt)
        if count > PARAGRAPH_MAX_LINES
    ]


def check_links(path: str, lines: Sequence[str], fenced: set[int], exists: Callable[[str], bool]) -> list[Problem]:
    """Rule g: relative links resolve. ``exists`` gets the target's path, joined to ``path``'s directory."""
    problems: list[Problem] = []
    for i, line in enumerate(lines):
        if i in fenced:
            continue
        text = _CODE_SPAN.sub(" ", line)
        targets = [m.group(1) for m in _LINK.finditer(text)] + [m.group(1) for m in _REFERENCE.finditer(text)]
        for target in targets:
            file = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if not file or _SCHEME.match(target):
                continue
            if file.startswith("/"):
                problems.append((i + 1, f"link {target!r} is absolute; make it relative to this file"))
                continue
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), file))
            if resolved.startswith("../") and not posixpath.isabs(path):
                problems.append((i + 1, f"link {target!r} leaves the repository"))
            elif not exists(resolved):
                problems.append((i + 1, f"broken link {target!r}: there is no {resolved}"))
    return problems


def check_text(text: str, path: str, exists: Callable[[str], bool] | None = None) -> list[Problem]:
    """Every rule on the Markdown ``text`` of ``path`` (relative to the repository root), sorted by line. Pure.

    Args:
        text: the file's content.
        path: its path; the README rule applies to a file named README.md, links resolve from its directory.
        exists: whether a path (the link's target joined to ``path``'s directory) exists; None skips rule g.
    """
    lines = text.splitlines()
    fenced = fenced_lines(lines)
    generated, problems = generated_blocks(lines, fenced)
    problems += check_words(lines, generated)
    problems += check_length(path, lines)
    problems += check_paragraphs(lines, generated | fenced)
    if exists is not None:
        problems += check_links(path, lines, fenced, exists)
    return sorted(problems)


def default_files(root: Path = ROOT) -> list[Path]:
    """README.md, CONTRIBUTING.md (if present) and docs/**/*.md outside docs/experiments/."""
    files = [root / name for name in ("README.md", "CONTRIBUTING.md") if (root / name).is_file()]
    docs = root / "docs"
    return files + sorted(p for p in docs.rglob("*.md") if "experiments" not in p.relative_to(docs).parts[:1])


def main(argv: Sequence[str] | None = None) -> int:
    """Check the files; print the problems (exit 1) or a summary (exit 0)."""
    parser = argparse.ArgumentParser(prog="python tools/check_docs.py", description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", type=Path, metavar="PATH", help="check these files instead")
    args = parser.parse_args(argv)
    files = args.files or default_files()
    count = 0
    for file in files:
        resolved = file.resolve()
        shown = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
        try:
            text = resolved.read_text(encoding="utf-8")
        except OSError as err:
            print(f"{shown}:0: cannot read ({err.strerror})")
            count += 1
            continue
        for line, what in check_text(text, shown, lambda p: (ROOT / p).exists()):
            print(f"{shown}:{line}: {what}")
            count += 1
    if count:
        print(f"check_docs: {count} problems in the user docs (rules: tools/check_docs.py)", file=sys.stderr)
        return 1
    print(f"check_docs: {len(files)} files, no commit hashes, HEAD, run numbers, long paragraphs or broken links")
    return 0


if __name__ == "__main__":
    sys.exit(main())
