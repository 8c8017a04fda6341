"""The layout every script keeps (DESIGN.md, "Skeleton"): size budgets that only go down, the plumbing last, only the
functions a script calls, and one text for one name across the scripts."""
import ast
import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["grpo", "ppo", "dpo", "hybrid", "reward_model", "sft", "capacity_ppo"]
# (file bytes, bytes above the `# ---- plumbing` line, lines of main()). A ratchet: lower a number when a change
# makes the script smaller; never raise one. A feature that needs bytes takes them from elsewhere in the same file.
BUDGETS = {
    "grpo": (83_365, 41_116, 95),
    "ppo": (83_042, 45_590, 120),
    "dpo": (67_199, 35_881, 100),
    "hybrid": (94_969, 57_517, 130),
    "reward_model": (77_855, 46_810, 110),
    "sft": (45_491, 15_636, 80),
    "capacity_ppo": (36_003, 23_800, 60),
}
PER_SCRIPT = {"Args", "main", "check_args"}  # each script's own by nature
# Args' base classes, the boxes of --help in this order (command_line); each script's own flags
GROUPS = {"Algorithm": "algorithm", "ModelData": "model-data", "Optimisation": "optimisation", "Logging": "logging",
          "Engineering": "engineering"}
PER_SCRIPT |= set(GROUPS)
# Same name, different text on purpose: name -> why.
DIFFERENT = {}


def parts(script: str) -> tuple[str, str, ast.Module]:
    text = (ROOT / f"{script}.py").read_text()
    marker = [m.start() for m in re.finditer(r"^# ---- plumbing", text, re.M)]
    assert len(marker) == 1, f"{script}.py needs exactly one line beginning '# ---- plumbing'"
    return text, text[: marker[0]], ast.parse(text)


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def source(text: str, node: ast.AST) -> str:
    lines = text.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "".join(lines[first - 1 : node.end_lineno])


@pytest.mark.parametrize("script", SCRIPTS)
def test_size_budgets(script):
    text, above, tree = parts(script)
    main = top_level(tree)["main"]
    size = (len(text.encode()), len(above.encode()), main.end_lineno - main.lineno + 1)
    budget = BUDGETS[script]
    over = [f"{what} {got:,} > {most:,}" for what, got, most in zip(("file bytes", "bytes above the plumbing line",
                                                                     "main() lines"), size, budget) if got > most]
    assert not over, f"{script}.py is over its budget: {', '.join(over)}. Take the bytes from elsewhere in the file."
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 120]
    assert not long, f"{script}.py has lines over 120 columns: {long[:10]}"


def test_the_readme_states_each_budget():
    readme = (ROOT / "README.md").read_text()
    for script, budget in BUDGETS.items():
        rows = [line for line in readme.split("## Size budgets")[-1].splitlines() if line.startswith(f"| `{script}.py` |")]
        cells = [c.strip().replace(",", "") for c in rows[0].split("|")[2:-1]] if rows else []
        assert cells == [str(b) for b in budget], f"README's size row for {script}.py: {cells}, budgets {budget}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_skeleton_order_and_only_what_the_script_calls(script):
    text, above, tree = parts(script)
    defs = top_level(tree)
    marker_line = above.count("\n") + 1
    assert defs["main"].lineno < marker_line, "main() comes before the plumbing"
    if "check_args" in defs:
        assert defs["check_args"].lineno > defs["main"].lineno, "check_args goes below main()"
    assert text.rstrip().endswith('if __name__ == "__main__":\n    command_line(Args, main)') or text.rstrip().endswith(
        'if __name__ == "__main__":\n    main(tyro.cli(Args))'), "the file ends with the __main__ guard"
    assert "matplotlib" not in text, "plotting is plot.py's"
    for name, node in defs.items():
        inside = {id(n) for n in ast.walk(node)}
        used = any(isinstance(n, ast.Name) and n.id == name and id(n) not in inside for n in ast.walk(tree))
        assert used or name == "main", f"{script}.py defines {name} but never calls it: a script carries only what it uses"


def test_one_name_one_text_across_the_scripts():
    texts: dict[str, dict[str, str]] = {}
    for script in SCRIPTS:
        text, _, tree = parts(script)
        for name, node in top_level(tree).items():
            texts.setdefault(name, {})[script] = source(text, node)
    differ = {name: sorted(by) for name, by in texts.items()
              if len(by) > 1 and len(set(by.values())) > 1 and name not in PER_SCRIPT | set(DIFFERENT)}
    assert not differ, f"same name, different text (make them one, or name them for what differs): {differ}"
    assert set(DIFFERENT) <= set(texts), "DIFFERENT lists a name no script has any more"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_opens_with_the_docstring_then_the_flags_in_their_groups(script, monkeypatch, capsys):
    """--help: usage, the module docstring's first paragraph, then a box per group of Args in the skeleton's order."""
    module = importlib.import_module(script)
    assert [g.__name__ for g in module.Args.__bases__[::-1]] == list(GROUPS)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    monkeypatch.setenv("COLUMNS", "100")  # one column of boxes
    with pytest.raises(SystemExit):
        module.command_line(module.Args, module.main)
    usage, description, boxes = capsys.readouterr().out.split("\n\n", 2)
    assert usage.startswith(f"usage: {script}.py")
    assert " ".join(description.split()) == " ".join(module.__doc__.split("\n\n")[0].split())
    titles_and_texts = re.split(r"^[^\w-]*([\w-]+) options\b.*$", boxes, flags=re.M)[1:]  # with or without rich's box
    assert titles_and_texts[::2] == list(GROUPS.values())
    box = {flag: title for title, text in zip(titles_and_texts[::2], titles_and_texts[1::2])
           for flag in re.findall(r"^[│ ]{1,3}(--[a-z][\w-]*)", text, re.M)}
    assert box["--learning-rate"] == box["--total-steps"] == "optimisation"
    assert (box["--resume"], box["--seed"], box["--save-every"]) == ("logging", "engineering", "logging")
    shown = [f for f in dataclasses.fields(module.Args) if "Suppress" not in str(f.type)]  # run_name: set at run time
    assert "--run-name" not in box and len(box) == len(shown)
