"""Random single-site mutants of the source, run against the tests: does the suite fail
when the code is wrong?

Draws N mutation sites at random (seeded) from the Python files under ``eth/`` and
``megatron/hpp/`` -- by default those changed since ``--base`` (a git revision), each
site on a changed line counted ``--changed-weight`` times -- applies each to a copy of
the checkout and runs the tests of the mutated file's package against it:

    python bench/mutants.py -n 10                      # files changed since HEAD~20
    python bench/mutants.py -n 20 --base main~60 --seed 3
    python bench/mutants.py -n 5 --files eth/cost/cut.py --whole-suite

Mutations (one per mutant): a comparison flipped (< and >=, <= and >, == and !=, in and
not in, is and is not), ``and`` and ``or`` swapped, an integer constant off by one, an
arithmetic operator changed (+ and -, * and /, // and %), a statement deleted (``pass``
in its place).  The statement holding the site is rewritten with ``ast.unparse``, so a
mutant's diff shows that statement reformatted.  A mutant is "caught" when the tests
fail or time out, "survived" when they pass, "unrunnable" when the mutated file does not
compile.  Whether a survivor is equivalent (no input tells it from the code) is for the
reader of its diff to say: the script prints every survivor's diff, and ``--whole-suite``
runs the survivors against every test before calling them survivors.

Package tests (``PACKAGE_TESTS``): eth/planner -> tests/planner, megatron/hpp ->
tests/runtime, eth/data -> tests/data, the rest of eth/ -> tests/foundation and the
top-level test files.  ``--tests`` names other ones.  Each run sets
``OMP_NUM_THREADS=1`` and stops at the first failure (``pytest -x``)."""
from __future__ import annotations

import argparse
import ast
import difflib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("eth", "megatron/hpp")
PACKAGE_TESTS = (("eth/planner/", ["tests/planner"]), ("megatron/hpp/", ["tests/runtime"]),
                 ("eth/data/", ["tests/data"]),
                 ("eth/", ["tests/foundation", "tests/test_simulate.py", "tests/test_show_plan.py"]))
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "out", "__pycache__", "*.egg-info", ".pytest_cache")

FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mod,
         ast.Mod: ast.FloorDiv}


@dataclass(frozen=True)
class Site:
    """One place to mutate: the file, the enclosing statement's lines, what to do."""

    path: str
    line: int
    """The mutated node's line (for the changed-line weighting)."""
    stmt: tuple[int, int]
    """First and last line of the statement rewritten."""
    kind: str
    index: int
    """Which node of that kind in the statement (ast.walk order)."""


def _kinds(node) -> list[str]:
    out = []
    if isinstance(node, ast.Compare):
        out += ["compare"] * sum(type(op) in FLIP for op in node.ops)
    elif isinstance(node, ast.BoolOp):
        out.append("boolop")
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in ARITH:
        out.append("arith")
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        out.append("const")
    return out


def _simple(stmt) -> bool:
    return isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr, ast.If, ast.While,
                             ast.Assert, ast.Raise)) and not (isinstance(stmt, ast.Expr) and
                                                             isinstance(stmt.value, ast.Constant))


def sites(path: str, source: str | None = None) -> list[Site]:
    """Every mutation site of the file at ``path`` (relative to the checkout; its text
    ``source`` if given)."""
    tree = ast.parse((ROOT / path).read_text() if source is None else source)
    out = []
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or not _simple(stmt):
            continue
        # the statement's own expression (an if's or while's test, not its body)
        head = [stmt.test] if isinstance(stmt, (ast.If, ast.While)) else [stmt]
        counts: dict[str, int] = {}
        for part in head:
            for node in ast.walk(part):
                if node is not stmt and isinstance(node, ast.stmt):
                    continue
                for kind in _kinds(node):
                    out.append(Site(path, getattr(node, "lineno", stmt.lineno), _span(stmt), kind,
                                    counts.get(kind, 0)))
                    counts[kind] = counts.get(kind, 0) + 1
        if not isinstance(stmt, (ast.If, ast.While)) and not isinstance(stmt, ast.Raise):
            out.append(Site(path, stmt.lineno, _span(stmt), "delete", 0))
    return out


def _span(stmt) -> tuple[int, int]:
    if isinstance(stmt, (ast.If, ast.While)):
        return stmt.lineno, stmt.test.end_lineno
    return stmt.lineno, stmt.end_lineno


def mutate(source: str, site: Site) -> str | None:
    """``source`` with ``site`` mutated (the statement rewritten), or None if it cannot be."""
    lines = source.splitlines(keepends=True)
    a, b = site.stmt
    text = "".join(lines[a - 1:b])
    indent = text[:len(text) - len(text.lstrip())]
    header = text.lstrip().startswith(("if ", "while ", "elif "))
    if site.kind == "delete":
        new = f"{indent}pass\n"
    else:
        body = text.strip()
        keyword = ""
        if header:   # rewrite only the test of an if / elif / while header
            keyword, _, body = body.partition(" ")
            body = body.rstrip().rstrip(":")
        try:
            tree = ast.parse(body, mode="eval" if header else "exec")
        except SyntaxError:
            return None
        seen = -1
        for node in ast.walk(tree):
            for kind in _kinds(node):
                if kind != site.kind:
                    continue
                seen += 1
                if seen != site.index:
                    continue
                if kind == "compare":
                    i = [k for k, op in enumerate(node.ops) if type(op) in FLIP][0]
                    node.ops[i] = FLIP[type(node.ops[i])]()
                elif kind == "boolop":
                    node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
                elif kind == "arith":
                    node.op = ARITH[type(node.op)]()
                else:
                    node.value += 1
                break
            else:
                continue
            break
        else:
            return None
        new = ast.unparse(tree)
        new = f"{indent}{keyword} {new}:\n" if header else "".join(f"{indent}{x}\n" for x in new.splitlines())
    out = "".join(lines[:a - 1]) + new + "".join(lines[b:])
    try:
        compile(out, site.path, "exec")
    except SyntaxError:
        return None
    return out


def changed(base: str) -> dict[str, set[int]]:
    """Source files changed since ``base`` and their changed lines (new numbering)."""
    out: dict[str, set[int]] = {}
    diff = subprocess.run(["git", "diff", "-U0", base, "--", *SOURCES], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    path = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[6:] if line.startswith("+++ b/") else None
            path = name if name and name.endswith(".py") and (ROOT / name).exists() else None
            if path:
                out.setdefault(path, set())
        elif line.startswith("@@") and path:
            new = line.split("+", 1)[1].split(" ", 1)[0]
            start, _, count = new.partition(",")
            out[path].update(range(int(start), int(start) + (int(count) if count else 1)))
    return out


def tests_for(path: str, given: list[str] | None) -> list[str]:
    if given:
        return given
    for prefix, tests in PACKAGE_TESTS:
        if path.startswith(prefix):
            return tests
    return ["tests"]


def run_tests(copy: Path, tests: list[str], timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    try:
        got = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                             cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "caught (timeout)"
    return "survived" if got.returncode == 0 else "caught"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10, help="mutants to draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", default="HEAD~20", help="draw from files changed since this git revision")
    ap.add_argument("--files", nargs="+", help="draw from these files instead (paths in the checkout)")
    ap.add_argument("--changed-weight", type=int, default=3, help="weight of a site on a changed line")
    ap.add_argument("--tests", nargs="+", help="tests to run instead of the mutated file's package's")
    ap.add_argument("--whole-suite", action="store_true", help="run each survivor against every test too")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per test run (over: caught)")
    args = ap.parse_args(argv)
    if args.n < 1:
        print(f"mutants: -n must be at least 1, got {args.n}", file=sys.stderr)
        return 2
    if args.files:
        missing = [f for f in args.files if not (ROOT / f).is_file() or not f.endswith(".py")]
        if missing:
            print(f"mutants: --files: not a Python file of the checkout: {', '.join(missing)}", file=sys.stderr)
            return 2
        lines = {f: set() for f in args.files}
    else:
        try:
            lines = changed(args.base)
        except subprocess.CalledProcessError as exc:
            print(f"mutants: --base {args.base}: git diff failed: {exc.stderr.strip().splitlines()[-1]}",
                  file=sys.stderr)
            return 2
    pool, weights = [], []
    for path in sorted(lines):
        for s in sites(path):
            pool.append(s)
            weights.append(args.changed_weight if s.line in lines[path] else 1)
    if not pool:
        print(f"mutants: no mutation site in {len(lines)} file(s) changed since {args.base}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp) / "checkout"
        shutil.copytree(ROOT, copy, ignore=COPY_IGNORE)
        drawn: set[Site] = set()
        while len(results) < args.n and len(drawn) < len(pool):
            site = rng.choices(pool, weights)[0]
            if site in drawn:
                continue
            drawn.add(site)
            source = (ROOT / site.path).read_text()
            mutant = mutate(source, site)
            diff = "".join(difflib.unified_diff(source.splitlines(keepends=True),
                                                (mutant or source).splitlines(keepends=True),
                                                f"a/{site.path}", f"b/{site.path}", n=1))
            if mutant is None:
                results.append((site, "unrunnable", 0.0, diff))
                continue
            (copy / site.path).write_text(mutant)
            t0 = time.perf_counter()
            try:
                verdict = run_tests(copy, tests_for(site.path, args.tests), args.timeout)
                if verdict == "survived" and args.whole_suite:
                    verdict = run_tests(copy, ["tests"], args.timeout)
                    verdict = verdict if verdict == "survived" else f"{verdict} (whole suite)"
            finally:
                (copy / site.path).write_text(source)
            results.append((site, verdict, time.perf_counter() - t0, diff))
            print(f"{len(results):3}/{args.n} {verdict:24} {time.perf_counter() - t0:6.1f} s  "
                  f"{site.path}:{site.line} {site.kind}", flush=True)
    caught = sum(v.startswith("caught") for _, v, _, _ in results)
    survived = [r for r in results if r[1] == "survived"]
    unrunnable = sum(v == "unrunnable" for _, v, _, _ in results)
    print(f"\n{len(results)} mutants: {caught} caught, {len(survived)} survived, {unrunnable} unrunnable "
          f"(seed {args.seed}; survivors: equivalent or missed, judge by the diffs below)")
    for site, _, _, diff in survived:
        print(f"\n--- survived: {site.path}:{site.line} {site.kind}\n{diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
