"""What a bench report records about the run: the checkout's commit and the load average."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's short commit, noting uncommitted changes to tracked files."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def portable_args(argv) -> list[str]:
    """``argv`` as a report records it: a path outside the checkout (a scratch folder of
    this machine) becomes DIR, one inside it relative to it, so that no tracked report
    holds a path of the machine it was made on."""
    out = []
    for arg in argv:
        path = Path(arg)
        if path.is_absolute():
            arg = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else "DIR"
        out.append(arg)
    return out


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, or "n/a"."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def add_output_args(parser, what: str) -> None:
    """``--out`` and ``--update-results``: a bench writes under out/bench/ unless told to
    replace the tracked files in bench/results/ (or given a path)."""
    parser.add_argument("--out", help=f"where {what} go (default: out/bench/..., the same layout as "
                                      "bench/results/)")
    parser.add_argument("--update-results", action="store_true",
                        help="write over the tracked files in bench/results/ instead of out/bench/")


def output_path(args, relative: str) -> Path:
    """Where a bench writes ``relative`` (a path under bench/results/): ``args.out`` if
    given, bench/results/ with ``--update-results``, else out/bench/ (untracked)."""
    if getattr(args, "out", None):
        return Path(args.out)
    base = ROOT / "bench" / "results" if args.update_results else ROOT / "out" / "bench"
    return base / relative


def write_doc_section(name: str, text: str, doc: Path = ROOT / "docs" / "EVALUATION.md") -> None:
    """Replace what lies between ``<!-- begin NAME -->`` and ``<!-- end NAME -->`` in ``doc``
    with ``text``: a table docs/EVALUATION.md shows, written by the bench that measured it."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    body = doc.read_text()
    if begin not in body or end not in body:
        raise SystemExit(f"{doc} has no {begin} ... {end} section to write")
    head, rest = body.split(begin, 1)
    doc.write_text(head + begin + "\n" + text.rstrip("\n") + "\n" + end + rest.split(end, 1)[1])


def write_results(args, name: str, rows: list, header: str, markdown, doc_note: str, whole: bool = True) -> None:
    """A bench's ``<name>.json`` (header and rows) and ``<name>.md`` (``markdown(rows, header)``)
    where :func:`output_path` puts them; with ``--update-results`` (and no ``--out``) also
    docs/EVALUATION.md's ``name`` section, headed by ``doc_note`` (the command) instead of
    the run's date, commit and load; not when the run is not ``whole`` (a subset of its cases)."""
    import json

    out = output_path(args, f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, header))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    if args.update_results and not args.out and whole:
        write_doc_section(name, markdown(rows, doc_note))
        print(f"wrote docs/EVALUATION.md's {name} table")
