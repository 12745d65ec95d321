"""The .tex tables a paper can include: a short caption, the packages named, braces balanced,
scaled to the text width; compiled by pdflatex where one is installed (CI installs it: .ci/run)."""
import re
import shutil
import subprocess

import pandas as pd
import pytest

from benchmark.report import write_tables
from benchmark.report.tables import LATEX_CAPTION_CHARS
from tests.benchmark.report.test_tables import paper_rows

pytestmark = pytest.mark.slow  # runs pdflatex in a subprocess where it exists


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("latex")
    write_tables(pd.DataFrame(paper_rows("mnist_optunet") + paper_rows("digits_optunet")), out)
    return out


@pytest.mark.parametrize("name", ["table1", "table2", "table3"])
def test_each_table_has_a_short_caption_and_its_structure(tables, name):
    text = (tables / f"{name}.tex").read_text()
    assert text.startswith(r"% \input{} into a document with \usepackage{booktabs,multirow,graphicx}")
    assert text.count(r"\begin{table}") == text.count(r"\end{table}") == 1
    assert text.count(r"\begin{tabular}") == text.count(r"\end{tabular}") == 1
    captions = re.findall(r"\\caption\{(.*?)\}\n", text)
    assert len(captions) == 1 and len(captions[0]) <= LATEX_CAPTION_CHARS
    assert re.search(r"\\resizebox\{\\linewidth\}\{!\}\{%\n\\begin\{tabular\}", text)
    unescaped = re.sub(r"\\[{}]", "", text)
    assert unescaped.count("{") == unescaped.count("}")
    assert not re.search(r"(?<!\\)%(?! \\input)", text.replace("{%\n", "{\n"))  # no stray comment


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no pdflatex on this machine (.ci/run installs TeX Live)")
def test_the_tables_compile_and_fit_the_page(tables):
    (tables / "doc.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs,multirow,graphicx}\n"
                                    "\\begin{document}\n\\input{table1.tex}\n\\input{table2.tex}\n\\input{table3.tex}\n"
                                    "\\end{document}\n")
    done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tables,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "Overfull \\hbox" not in done.stdout, [line for line in done.stdout.splitlines() if "Overfull" in line]
    assert (tables / "doc.pdf").stat().st_size > 0
