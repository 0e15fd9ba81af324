"""The key tables of docs/ are generated from the config dataclasses (train/config_docs.py): each
marked table equals what the dataclasses render now, every config dataclass has one, and the
check notices a table that disagrees."""
import dataclasses

import pytest

from train.config_docs import DOCS, REGION, config_classes, field_comments, main, render, update


def test_every_marked_table_agrees_with_its_dataclass():
    classes = config_classes()
    stale = {page.name: update(page.read_text(), classes, str(page))[1] for page in DOCS.glob("*.md")}
    assert not any(stale.values()), f"run python -m train.config_docs: {stale}"
    assert main(["--check"]) == 0


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
    bad = good.replace("| `n_layers` | int | 8 | > 0 |", "| `n_layers` | int | 12 | > 0 |")
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
