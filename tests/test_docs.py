"""README.md, ARCHITECTURE.md and docs/ checked against the code: the stages and analyses they list,
the config keys and ``make`` targets they name, the experiments, every relative link, the README's
length. Each check also runs on a planted mistake, so that it can be seen to fail."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from benchmark.config import CONF_DIR
from benchmark.loader import analysis_names, compose_config
from benchmark.stages import PIPELINE, STAGES
from tests.conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, REPO / "ARCHITECTURE.md", *DOCS]
MAX_README_LINES = 300
EXAMPLE_KEYS = {"methods.noise.sigma"}  # the README's example method, registered only by tests/methods/test_own_method.py


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def broken_links(page: Path, text: str) -> list[str]:
    """Relative Markdown links of ``text`` (``page``'s) whose target does not exist."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            out.append(target)
    return out


def override_keys(text: str) -> set[str]:
    """Config keys set as ``key=value`` in ``text`` (Hydra's own ``hydra.*`` and ``+`` additions left out)."""
    keys = set(re.findall(r"(?<![\w.+/$-])([a-z_]+(?:\.[a-z0-9_]+)+)=", text))
    return {k for k in keys if not k.startswith("hydra.") and k not in EXAMPLE_KEYS}


def unknown_keys(keys: set[str]) -> list[str]:
    """The ``keys`` in no composed config: the default one, or one per reference choice (whose
    node holds that reference's own settings, ``reference=<name>``)."""
    choices = sorted(p.stem for p in (Path(CONF_DIR) / "reference").glob("*.yaml"))
    configs = [compose_config([f"reference={name}"]) for name in choices]
    return sorted(k for k in keys if all(OmegaConf.select(cfg, k, default="<absent>") == "<absent>" for cfg in configs))


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", text_of(REPO / "Makefile"), re.M))


def named_targets(text: str) -> set[str]:
    """Targets of ``make`` in inline code or at the start of a (code) line."""
    return set(re.findall(r"(?:`|^)make ([a-z][a-z-]+)", text, re.M))


def test_the_readme_is_at_most_300_lines():
    assert len(text_of(README).splitlines()) <= MAX_README_LINES


def test_every_relative_link_resolves():
    assert {str(p.relative_to(REPO)): broken_links(p, text_of(p)) for p in PAGES} == {str(p.relative_to(REPO)): [] for p in PAGES}
    assert broken_links(README, "see [the store](docs/stor.md) and [hmc](docs/hmc.md)") == ["docs/stor.md"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.split("#")[0]).name for t in re.findall(r"\]\((docs/[^)\s]+)\)", text_of(README))}
    assert {p.name for p in DOCS} <= linked


def test_the_stage_table_and_stage_all_are_the_code_s():
    text = text_of(README)
    listed = re.findall(r"^\| `([a-z_]+)` \|", text.split("## Reading the outputs")[1].split("\n## ")[0], re.M)
    assert sorted(listed) == sorted(STAGES)
    assert f"`stage=all` runs {', '.join(PIPELINE[:-1])} and {PIPELINE[-1]} in order" in " ".join(text.split())


def test_the_analyses_listed_are_the_code_s():
    readme = re.search(r"analysis=([a-z_|\\]+)", text_of(README)).group(1).replace("\\", "").split("|")
    assert readme == [*analysis_names(), "all"]
    table = re.findall(r"^\| `([a-z_]+)` \|", text_of(REPO / "docs" / "analyses.md"), re.M)
    assert table == list(analysis_names())


def test_the_config_keys_named_exist():
    keys = set().union(*(override_keys(text_of(p)) for p in PAGES))
    assert len(keys) > 25  # the pages name many keys: the scan finds them
    assert unknown_keys(keys) == []
    assert unknown_keys(override_keys("zoo_import.limit=3 sample.repetitons=2")) == ["sample.repetitons"]


def test_the_make_targets_named_exist():
    named = set().union(*(named_targets(text_of(p)) for p in PAGES))
    assert {"benchmark", "test", "test-fast", "hmc", "bench", "verify", "reliability"} <= named
    assert named - make_targets() == set()
    assert named_targets("run `make benchmarks`; make overlapping jobs safe") - make_targets() == {"benchmarks"}


def test_the_experiments_listed_exist():
    listed = set(re.findall(r"^\| `(\w+)`(?: \(default\))? \| (?:OptuNet|ResNet)", text_of(README), re.M))
    assert listed == {p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")}


def quoted_tables(text: str) -> list[list[str]]:
    """The Table 1 blocks quoted in ``text``: runs of Markdown table lines whose header starts ``| Experiment``."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| Experiment"):
            block = [line]
            for nxt in lines[i + 1:]:
                if not nxt.startswith("|"):
                    break
                block.append(nxt)
            blocks.append(block)
    return blocks


def stale_tables(text: str, committed: list[list[str]]) -> list[str]:
    """First rows of the Table 1 blocks of ``text`` that are not, line for line, one of ``committed``'s."""
    return [block[2] for block in quoted_tables(text) if block not in committed]


def test_the_readme_quotes_the_committed_tables():
    committed = [quoted_tables(text_of(p))[0] for p in sorted((REPO / "results").glob("*/table1.md"))]
    assert len(quoted_tables(text_of(README))) >= 2  # digits and MNIST: the scan finds them
    assert stale_tables(text_of(README), committed) == []
    planted = text_of(README).replace("| 60.5 ± 3.1 |", "| 60.4 ± 3.1 |", 1)
    assert len(stale_tables(planted, committed)) == 1


@pytest.mark.parametrize("path", ["studies/check_sghmc.py", "studies/recipe_digits.py", "studies/hmc_unit.py",
                                  "studies/sghmc_stationarity.py", "studies/hmc_within_start.py"])
def test_each_study_says_its_question_and_last_result(path):
    first = text_of(REPO / path).split("\n", 1)[0]
    assert first.startswith('"""Study: ') and "?" in first and "Last result" in first
