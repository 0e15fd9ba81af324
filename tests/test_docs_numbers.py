"""README.md and docs/*.md against the techniques report and the commands behind their numbers.

Three checks on the committed files (they read files only):
- a verdict the docs state about a claim the report judges equals the report's row in
  docs/report/report.json (a "holds" in the docs over a report row that says "no verdict" or
  "partly" fails);
- numbers the docs say are the report's equal the report's (the optimizer-state table);
- every block of text (paragraph, list item, table) that states a measured time or speed (ms, s,
  min, GB/s, img/s, tokens/s, or a speed ratio like 1.23x) names the command it came from, in
  itself or in one of the blocks just before it in the same section (tables generated from a
  benchmark's JSON carry their command in the JSON and a line above them).
The checkers are run on made-up text first, so that a test that passes is one that could fail.
docs/report/report.md itself is generated from the JSON (tests/test_report.py).
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "report" / "report.json"
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# -------------------------------------------------------------------- blocks and sentences
CODE_FENCE = re.compile(r"^\s*```")


def blocks(text: str):
    """(section heading, block) in order: a block is a paragraph, a list item or a table outside
    code fences and generated key tables (<!-- keys:... -->); a heading yields (heading, None)."""
    out, cur, head, fence, keys = [], [], "", False, False

    def flush():
        if cur:
            out.append((head, "\n".join(cur)))
            cur.clear()
    for line in text.splitlines():
        if CODE_FENCE.match(line):
            fence = not fence
            flush()
            continue
        if fence:
            continue
        if line.startswith("<!-- keys:"):
            keys = True
        if keys:
            keys = not line.startswith("<!-- /keys")
            continue
        if line.startswith("#"):
            flush()
            head = line.strip("# ")
            out.append((head, None))
        elif not line.strip() or re.match(r"\s*[-*] ", line):  # a blank line or a list item starts a block
            flush()
            if line.strip():
                cur.append(line)
        else:
            cur.append(line)
    flush()
    return out


def sentences(text: str):
    """The sentences of a page's prose (blocks joined, split after '.', ';' or ':' and a space)."""
    for _, b in blocks(text):
        if b is not None and not b.startswith("|"):
            yield from (s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z(`*])", " ".join(b.split())) if s.strip())


# -------------------------------------------------------------------- verdicts
# which report row a sentence speaks of: the technique's names in the docs, and the words of the
# row's claim (a sentence naming LoRA's trainable parameters is not about its memory claim)
CLAIMS = {
    "MoE (equal compute)": (r"\bMoE\b|Mixture.of.Experts", r"loss|sooner|same compute|equal compute"),
    "Mixture-of-Depths (equal FLOPs)": (r"\bMoD\b|Mixture.of.Depths", r"loss|same compute|equal (training )?FLOPs"),
    "LoRA (training state)": (r"\bLoRA\b", r"memory"),
    "QLoRA (base weights)": (r"\bQLoRA\b", r"4 bits|base weights"),
    "adamw8bit (state memory)": (r"8-bit AdamW|adamw8bit", r"state"),
    "lion (state memory)": (r"\bLion\b", r"stateless|state\b"),
    "sgd (state memory)": (r"\bSGD\b", r"stateless|state\b"),
    "adafactor (state memory)": (r"\bAdafactor\b", r"state\b"),
    "TAESD latents": (r"\bTAESD\b", r"compress"),
    "Min-SNR-gamma weighting": (r"Min-SNR", r"converge|loss|MSE"),
    "stochastic depth (speed)": (r"stochastic depth|drop.path", r"faster|speed|images/s"),
    "EMA of the weights": (r"\bEMA\b", r"evaluates better|lower loss|val loss"),
    "checkpoint averaging": (r"checkpoint averaging|average of the last", r"lower loss|val loss"),
}
VERDICT_WORDS = [  # (pattern, the report's verdict it states); the first that matches counts
    (r"no verdict|one seed", "no verdict"),
    (r"does not hold|doesn't hold|is refuted", "does not hold"),
    (r"inconclusive", "inconclusive"),
    (r"\bpartly\b", "partly"),
    (r"claim\w*\b[^;]*\bholds\b|\bholds (?:here|at this|for the|true)|as claimed|claim\w*\b[^;]*\bis met\b", "holds"),
]


def stated_verdict(sentence: str):
    for pattern, verdict in VERDICT_WORDS:
        if re.search(pattern, sentence, re.I):
            return verdict
    return None


def verdict_conflicts(text: str, rows: dict) -> list[str]:
    """Sentences of `text` that state a verdict on a claim the report judges, other than the report's."""
    bad = []
    for s in sentences(text):
        said = stated_verdict(s)
        if said is None:
            continue
        for tech, (names, claim_words) in CLAIMS.items():
            if tech in rows and re.search(names, s) and re.search(claim_words, s, re.I):
                if not rows[tech]["verdict"].startswith(said):
                    bad.append(f"{tech}: the docs say {said!r}, the report {rows[tech]['verdict']!r}: {s[:160]}")
    return bad


# -------------------------------------------------------------------- commands behind numbers
MEASURED = re.compile(
    r"(?<![\w.\-/^])\d+(?:\.\d+)? ?(?:ms|GB/s|MB/s|img/s|images/s|tokens/s|tok/s)(?!\w)"  # times and rates
    r"|(?<![\w.\-/^])\d+(?:\.\d+)? (?:s|min)(?![\w/])"                                    # seconds, minutes
    r"|(?<![\w.\-/^])\d+\.\d+x(?!\w)")                                                    # measured ratios: 1.23x
COMMAND = re.compile(r"python (?:-m )?[\w/.]+\.py|python -m \w|bench\.py \w|`time |\.ci/run|tests/test_\w+\.py")
WINDOW = 3  # the command may stand this many blocks before the number, in the same section


def uncited(text: str) -> list[str]:
    """Blocks that state a measured time, rate or speed ratio with no command in themselves or
    in the WINDOW blocks before them in their section."""
    bad, before = [], []
    for head, b in blocks(text):
        if b is None:
            before = []
            continue
        if MEASURED.search(b) and not any(COMMAND.search(x) for x in before[-WINDOW:] + [b]):
            bad.append(f"[{head}] {MEASURED.search(b).group(0)!r} in: {' '.join(b.split())[:160]}")
        before.append(b)
    return bad


# -------------------------------------------------------------------- the checkers on made-up text
def test_the_checkers_catch_what_they_are_for():
    rows = {"MoE (equal compute)": {"verdict": "no verdict: one seed"},
            "LoRA (training state)": {"verdict": "partly"},
            "adamw8bit (state memory)": {"verdict": "holds"}}
    page = ("# x\n\nThe seed's claim holds here: the MoE runs end below dense in loss.\n\n"
            "Trainable parameters: 55x fewer with LoRA, as claimed.\n\n"
            "8-bit AdamW saves 75% of AdamW's state, as claimed.\n\n"
            "LoRA's memory claim holds for the model state.\n")
    bad = verdict_conflicts(page, rows)
    assert len(bad) == 2 and bad[0].startswith("MoE") and bad[1].startswith("LoRA")  # not the parameters, not 8-bit AdamW
    assert verdict_conflicts(page.replace("claim holds here", "one seed, no verdict")
                             .replace("memory claim holds", "memory claim holds partly"), rows) == []
    page = ("# Speed\n\nMeasured by `python train/bench.py resnet`:\n\n| a | b |\n|---|---|\n| 1.2 ms | 1.05x |\n\n"
            "Reading it: 1.05x.\n\n## Other\n\nA profile gave 4.6 ms to 1.9 ms, and 10-20 GB/s.\n\n"
            "A 3x3 convolution, 8x downscale, CRC-32s, 5GB shards, 2020s.\n\n```\nrun 12.0 s\n```\n")
    bad = uncited(page)
    assert len(bad) == 1 and "4.6 ms" in bad[0] and bad[0].startswith("[Other]")
    assert uncited(page.replace("A profile gave", "`python train/bench.py x` gave")) == []


# -------------------------------------------------------------------- the committed docs
def report_rows() -> dict:
    return {r["technique"]: r for r in json.loads(REPORT.read_text())["rows"]}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_verdicts_agree_with_the_report(page):
    assert verdict_conflicts(page.read_text(), report_rows()) == []


def test_optimizer_state_table_is_the_reports():
    """docs/llm.md's optimizer-state table says it is the report's numbers at the same shape."""
    text = (ROOT / "docs" / "llm.md").read_text()
    table = dict(re.findall(r"^\| (\w+) \| ([\d.]+) \| [\d.]+ \| \d+% \|$", text, re.M))
    rows = report_rows()
    for name in ("sgd", "adafactor", "lion", "adamw8bit"):
        memory = rows[f"{name} (state memory)"]["memory"]  # "state 321.1 -> 160.5 MiB (...)"
        adamw, state = re.match(r"state ([\d.]+) -> ([\d.]+) MiB", memory).groups()
        assert (table["adamw"], table[name]) == (adamw, state), (name, memory)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_measured_number_names_its_command(page):
    assert uncited(page.read_text()) == []


def test_readme_states_the_committed_reports_run():
    """README's paragraph on the committed report: its wall time and seeds are report.json's."""
    text = " ".join((ROOT / "README.md").read_text().split())
    page = json.loads(REPORT.read_text())
    minutes = re.search(r"`python train/bench.py report --out docs/report` with (\w+) seeds? per quality "
                        r"comparison \((\d+) min on the idle machine", text)
    assert minutes, "README no longer states how the committed report was measured"
    seeds = {"one": 1, "two": 2, "three": 3}.get(minutes.group(1), minutes.group(1))
    assert str(seeds) == str(page["page"]["seeds"])
    assert int(minutes.group(2)) == round(page["timing"]["total"] / 60)
