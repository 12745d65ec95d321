"""Methods describe themselves: how a reader takes a method's rows (its table note, its family's note)
and what its diagnostics columns mean are attributes of its class, so a new method is one module in
``methods/`` and one yaml, and no file of the report (or any other) is edited: the test writes one
into a copy of the packages and reads its notes and its diagnostics.md section back through the
report, in a subprocess of the copy."""
from __future__ import annotations

import filecmp
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pandas as pd

from benchmark.report.diagnostics import BASE_COLUMNS, diagnostics_notes, render
from benchmark.report.tables import variant_notes
from methods import METHODS, method_class, method_names
from tests.conftest import REPO

COPIED = ("benchmark", "methods", "metrics", "conf")

NEW_METHOD = '''"""Weight noise around the base network, with its own notes."""
from __future__ import annotations

from methods.base import PosteriorMethod


class NoiseMethod(PosteriorMethod):
    name = "noise"
    label = "Weight noise"
    order = 75  # between SWAG (70) and Laplace (80)
    table_note = "{label}: isotropic noise, a naive row."
    diagnostics_note = "Weight noise: sigma, the noise's standard deviation."
    paper_label = "SWAG"  # set beside the paper's SWAG, after our SWAG (not the paper's recipe)
    paper_recipe = False

    def fit(self, base, seed):
        self.base = base

    def sample(self, n, seed):
        return {}
'''

READ_BACK = textwrap.dedent('''
    import json, math
    import pandas as pd
    from benchmark.report.diagnostics import BASE_COLUMNS, diagnostics_notes, render
    from benchmark.report.findings import paper_claims
    from benchmark.report.paper import beside
    from benchmark.report.tables import variant_notes
    from methods import method_names
    row = {c: math.nan for c in BASE_COLUMNS} | {"method": "noise", "method_label": "Weight noise", "mode": "one",
                                                  "n_samples": 4, "n_bases": 1, "sigma": 0.25}
    print(json.dumps({"methods": list(method_names()), "notes": variant_notes(["swag", "noise", "sghmc_sa"]),
                      "sections": [name for name, _ in diagnostics_notes()],
                      "diagnostics": render(pd.DataFrame([row]), "Digits"), "beside": beside("SWAG"),
                      "claims": [[c.text, [[*x.a, *x.b, x.column] for x in c.comparisons]] for c in paper_claims(
                          {("noise", "one"), ("noise", "multi"), ("laplace", "one"), ("ensemble", "multi")})]}))
''')


def test_the_notes_come_from_the_methods_in_table_row_order():
    notes = variant_notes(["ensemble", "bnn_skip", "external", "bnn", "bnn_ordered"])
    family = METHODS["bnn"].family_note
    assert family is not None and notes.count(family) == 1 and notes[0] == family  # the vBNNs' note once, first
    own = [method_class(m).table_note.format(label=method_class(m).label) for m in ("bnn_ordered", "bnn_skip", "ensemble")]
    assert notes[1:] == own and all(n.startswith(method_class(m).label + ":") for n, m in
                                    zip(own, ("bnn_ordered", "bnn_skip", "ensemble")))
    assert variant_notes(["swag", "dropout"]) == [] and variant_notes(["external"]) == []
    sections = [name for name, _ in diagnostics_notes()]
    assert sections == [m for m in method_names() if method_class(m).diagnostics_note is not None]
    assert sections == ["bnn", "sghmc", "sghmc_sa", "swag", "laplace"]  # the variants keep the plain vBNN's only


def test_a_method_without_a_note_gets_no_diagnostics_section():
    row = {c: math.nan for c in BASE_COLUMNS} | {"method": "dropout", "method_label": "Dropout", "mode": "one",
                                                  "n_samples": 4, "n_bases": 1, "p": 0.2}
    text = render(pd.DataFrame([row]), "Digits")
    assert "## Dropout" not in text
    row |= {"method": "swag", "method_label": "SWAG", "swag_variance": 0.5}
    text = render(pd.DataFrame([row]), "Digits")
    assert "## SWAG" in text and METHODS["swag"].diagnostics_note in text and "swag_variance" in text


def test_a_new_method_is_read_by_the_report_with_no_report_file_edited(tmp_path):
    copy = tmp_path / "repo"
    for folder in COPIED:
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "methods" / "noise.py").write_text(NEW_METHOD)
    done = subprocess.run([sys.executable, "-c", READ_BACK], cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["methods"] == [*list(method_names())[:7], "noise", *list(method_names())[7:]]  # by its order
    assert out["notes"] == [METHODS["sghmc_sa"].table_note.format(label=METHODS["sghmc_sa"].label),
                            "Weight noise: isotropic noise, a naive row."]
    assert out["sections"] == ["bnn", "sghmc", "sghmc_sa", "swag", "noise", "laplace"]
    section = out["diagnostics"][out["diagnostics"].index("## Weight noise"):]
    assert "Weight noise: sigma, the noise's standard deviation." in section and "0.25" in section
    assert out["beside"] == ["swag", "noise"]  # paper.md: beside the paper's SWAG, after the paper's recipe
    claims = dict((text, comparisons) for text, comparisons in out["claims"])  # findings.md: in the paper's claims
    assert claims["Deep Ensembles have the lowest MMD of all rows."] == [
        ["ensemble", "multi", m, mode, "mmd_median"] for m, mode in (("laplace", "one"), ("noise", "multi"), ("noise", "one"))]
    assert claims["For every method, the multi-mode MMD is below the one-mode MMD."] == [
        ["noise", "multi", "noise", "one", "mmd_median"]]  # laplace has one mode here: not paired
    assert claims["After Deep Ensembles, Laplace has the lowest MMD and NS MMD (within each mode)."] == [
        ["laplace", "one", "noise", "one", column] for column in ("mmd_median", "ns_mmd_median")]
    edited = {path.relative_to(copy).as_posix() for folder in COPIED for path in (copy / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts
              and not ((REPO / path.relative_to(copy)).is_file()
                       and filecmp.cmp(path, REPO / path.relative_to(copy), shallow=False))}
    assert edited == {"methods/noise.py"}  # the one new file; no report (or other) file edited
