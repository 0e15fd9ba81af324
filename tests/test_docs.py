"""The generated tables of docs/ (train/docs.py): the key tables from the config dataclasses and the
number tables from the benches' results (docs/results/NAME.json). Each marked region equals what
renders now (`python -m train.docs --check`), every config dataclass has a key table, every result
has the fields the renderer reads, and the check names a region that disagrees."""
import dataclasses
import json
import re
import typing

import pytest

from train.docs import DOCS, REGION, RESULTS, TABLE, config_classes, field_comments, main, markdown, render, update


def test_every_region_agrees_with_its_code_or_result(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_every_marked_table_agrees_with_its_dataclass():
    classes = config_classes()
    stale = {page.name: update(page.read_text(), classes, str(page))[1] for page in DOCS.glob("*.md")}
    assert not any(stale.values()), f"run python -m train.docs: {stale}"


def test_every_config_dataclass_has_a_table_with_every_field():
    marked = {m.group(2): m.group(3) for page in DOCS.glob("*.md") for m in REGION.finditer(page.read_text())}
    for name, cls in config_classes().items():
        assert name in marked, f"no <!-- keys:{name} --> table in docs/"
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in marked[name], (name, f.name)


def test_a_table_that_disagrees_is_reported_and_rewritten():
    classes = config_classes()
    good = "<!-- keys:LLMConfig -->\n" + render(classes["LLMConfig"]) + "<!-- /keys -->"
    assert update(good, classes)[1] == []
    bad = good.replace("| `vocab_size` | int | 32000 | > 0 |", "| `vocab_size` | int | 12 | > 0 |")
    assert bad != good
    fixed, changed = update(bad, classes)
    assert changed == ["LLMConfig"] and fixed == good
    with pytest.raises(ValueError, match="keys:NoSuchConfig"):
        update("<!-- keys:NoSuchConfig -->\n<!-- /keys -->", classes, "x.md")


def test_a_comment_continues_on_the_indented_lines_below_its_field():
    from train.config import TrainConfig
    comments = field_comments(TrainConfig)
    assert comments["memory_budget"].startswith("with `batch_size: auto`") and "free memory" in comments["memory_budget"]
    assert "bounds" not in render(TrainConfig).split("\n")[2]  # the first row is a key, not the header
    row = next(r for r in render(TrainConfig).split("\n") if r.startswith("| `ema_decay` |"))
    assert "| float or null | null | in (0, 1) |" in row


def test_every_result_has_what_the_renderer_reads():
    """docs/results/*.json: the command that made it, the machine, the date, and named tables of columns and
    rows of text (each row as long as the columns; notes and a table's own command optional); numbers in `data`."""
    results = sorted(RESULTS.glob("*.json"))
    assert results
    for path in results:
        r = json.loads(path.read_text())
        assert {"command", "machine", "date", "tables", "data"} <= set(r), path.name
        assert "bench.py" in r["command"] and r["machine"] and r["date"], path.name
        assert r["tables"] and all(isinstance(k, str) for k in r["tables"]), path.name
        for key, t in r["tables"].items():
            assert set(t) <= {"columns", "rows", "notes", "command"}, (path.name, key)
            assert t["columns"] and all(isinstance(c, str) for c in t["columns"]), (path.name, key)
            assert all(len(row) == len(t["columns"]) and all(isinstance(c, str) for c in row) for row in t["rows"]), \
                (path.name, key)


def test_every_region_names_a_result():
    named = {m.group(2) for page in DOCS.glob("*.md") for m in TABLE.finditer(page.read_text())}
    assert named and all((RESULTS / f"{n}.json").is_file() for n in named), named


def test_a_result_table_that_disagrees_is_reported_and_rewritten(tmp_path, capsys):
    result = {"command": "python train/bench.py x --rounds 2", "machine": "a CPU", "date": "today", "data": {},
              "tables": {"a": {"columns": ["side", "s"], "rows": [["zoo", "1.0"], ["ref", "2|3"]], "notes": "a note"},
                         "b": {"columns": ["k"], "rows": [["v"]], "command": "python train/bench.py x --other"}}}
    (tmp_path / "x.json").write_text(json.dumps(result))
    a = markdown(result["tables"]["a"])
    assert a == "| side | s |\n|---|---|\n| zoo | 1.0 |\n| ref | 2\\|3 |\n\na note\n"
    made_a = "\nMade by `python train/bench.py x --rounds 2` on a CPU, today.\n"
    made_b = "\nMade by `python train/bench.py x --other` on a CPU, today.\n"
    good = f"<!-- table:x/a -->\n{a}{made_a}<!-- /table -->\n<!-- table:x -->\n{a}\n| k |\n|---|\n| v |\n{made_b}{made_a}<!-- /table -->"
    assert update(good, {}, results=tmp_path) == (good, [])
    bad = good.replace("| zoo | 1.0 |", "| zoo | 0.9 |", 1)
    fixed, changed = update(bad, {}, results=tmp_path)
    assert changed == ["table:x/a"] and fixed == good
    for region, message in (("<!-- table:y -->\n<!-- /table -->", "no result"),
                            ("<!-- table:x/c -->\n<!-- /table -->", "has no table 'c'")):
        with pytest.raises(ValueError, match=message):
            update(region, {}, "page.md", results=tmp_path)


def test_the_check_names_each_stale_region(tmp_path, monkeypatch, capsys):
    import train.docs as docs
    (tmp_path / "page.md").write_text("<!-- table:drop-path -->\n| stale |\n<!-- /table -->\n")
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check"]) == 1
    assert "page.md: table:drop-path" in capsys.readouterr().err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0


def test_the_parallel_table_names_tests_that_exist():
    """docs/distributed.md's table of combinations under torchrun: every test it names is defined in
    tests/test_distributed.py or test_distributed_cases.py with the cases it names, and every column's key is
    one of the tests."""
    import re
    from pathlib import Path
    from train.docs import PARALLEL_COMBINATIONS, PARALLEL_TESTS
    here = Path(__file__).parent
    source = "".join((here / f).read_text() for f in ("test_distributed.py", "test_distributed_cases.py"))
    assert all(f"\ndef {name}(" in source for name in PARALLEL_TESTS.values())
    for row, _, *cells in PARALLEL_COMBINATIONS:
        for ref in (r for cell in cells for r in cell.split(", ") if cell and not cell.startswith("n/a")):
            key, case = re.fullmatch(r"(\w+)(?:\[([\w-]+)\])?(?: \(.*\))?", ref).groups()
            assert key in PARALLEL_TESTS, (row, ref)
            assert case is None or all(f'"{part}"' in source for part in case.split("-")), (row, ref)


def test_a_table_key_may_hold_spaces(tmp_path):
    """<!-- table:NAME/KEY --> with a key such as "training bf16" renders that table alone."""
    result = {"command": "python train/bench.py x", "machine": "a CPU", "date": "today", "data": {},
              "tables": {"training bf16": {"columns": ["k"], "rows": [["bf16"]]},
                         "training fp32": {"columns": ["k"], "rows": [["fp32"]]}}}
    (tmp_path / "x.json").write_text(json.dumps(result))
    text, changed = update("<!-- table:x/training bf16 -->\n<!-- /table -->", {}, results=tmp_path)
    assert changed == ["table:x/training bf16"] and "| bf16 |" in text and "fp32" not in text


def first_column(page: str, header: str) -> list[str]:
    """The first cell's first `code` of each row of the table of docs/PAGE whose header row starts with
    `header`, quotes and a `:ARG` part left out (`"f16"` -> f16, `format:REGEX` -> format)."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        code = re.search(r"`([^`]+)`", line.split("|")[1])
        names.append(code.group(1).strip('"').split(":")[0])
    return names


def literal(cls, key: str) -> list[str]:
    return list(typing.get_args(typing.get_type_hints(cls)[key]))


def test_hand_written_lists_of_choices_are_the_code_s():
    """The tables that explain each choice of a key by hand (what each does is prose no code holds) name
    exactly the choices the code has, so a choice added or removed fails here until the table follows."""
    from train.config import TrainConfig
    from train.data import TextDataConfig
    from train.data.conversations import FORMATS
    from train.data.prompts import BUILTIN
    from train.optim import OPTIMIZERS
    from train.tasks.dpo import PreferenceDataConfig
    from train.tasks.rl import RLConfig
    from zoo.quantization import SCHEMES
    from zoo.weights.gguf_llm import WRITE_TYPES
    cases = [("llm.md", "| name | what runs |", list(OPTIMIZERS)),
             ("pretrained.md", "| `dtype` |", list(WRITE_TYPES)),
             ("deploy.md", "| scheme |", list(SCHEMES)),
             ("post-training.md", "| `data.format` |", list(FORMATS)),
             ("post-training.md", "| `data.loss` |", literal(PreferenceDataConfig, "loss")),
             ("post-training.md", "| `rl.algorithm` |", literal(RLConfig, "algorithm")),
             ("post-training.md", "| name | reward |", [*BUILTIN, "format", "length", "module"]),
             ("data.md", "| `data.boundary` |", literal(TextDataConfig, "boundary")),
             ("distributed.md", "| `train.parallel` |", literal(TrainConfig, "parallel"))]
    for page, header, names in cases:
        assert sorted(first_column(page, header)) == sorted(names), (page, header)
