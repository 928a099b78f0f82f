"""bench/mutants.py: the sites it finds in a small source and what each mutation writes."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutants", ROOT / "bench" / "mutants.py")
mutants = sys.modules["mutants"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)

SOURCE = '''def f(a, b):
    """Doc."""
    x = a + 2 * b
    if a < b and b != 0:
        x -= 1
    return x
'''


def test_every_kind_of_site_and_its_mutant():
    found = mutants.sites("f.py", SOURCE)
    by = {(s.kind, s.line, s.index): s for s in found}
    assert sorted({s.kind for s in found}) == ["arith", "boolop", "compare", "const", "delete"]
    assert not any(s.line == 2 for s in found)                         # the docstring is no site

    def mutant(kind, line, index=0):
        out = mutants.mutate(SOURCE, by[kind, line, index])
        compile(out, "f.py", "exec")
        return [x for x in out.splitlines() if x not in SOURCE.splitlines()]

    assert mutant("arith", 3) == ["    x = a - 2 * b"]
    assert mutant("arith", 3, 1) == ["    x = a + 2 / b"]
    assert mutant("const", 3) == ["    x = a + 3 * b"]
    assert mutant("delete", 3) == ["    pass"]
    assert mutant("compare", 4) == ["    if a >= b and b != 0:"]
    assert mutant("compare", 4, 1) == ["    if a < b and b == 0:"]
    assert mutant("boolop", 4) == ["    if a < b or b != 0:"]
    assert mutant("arith", 5) == ["        x += 1"]
    assert mutant("delete", 6) == ["    pass"]
    ns = {}
    exec(mutants.mutate(SOURCE, by["compare", 4, 0]), ns)
    assert ns["f"](1, 2) == 5 and ns["f"](3, 2) == 6   # the flipped test decides the other way


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert mutants.main(["-n", "0"]) == 2
    assert mutants.main(["--files", "nope.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mutants: -n must be at least 1, got 0",
                   "mutants: --files: not a Python file of the checkout: nope.py"]
