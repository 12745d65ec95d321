"""The store-content scenarios of ``make reliability`` (bench/reliability.py, part 4), run as they
are: each must hold (covered metadata, validated reads, a verify that judges without destroying,
caches recomputed after a code change, imported stores clean, mixed pairs refused)."""
import pytest

from bench import reliability

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]


@pytest.mark.parametrize("name,scenario", reliability.SCENARIOS_STORE_CONTENT,
                         ids=[name for name, _ in reliability.SCENARIOS_STORE_CONTENT])
def test_store_content_scenario_holds(tmp_path, name, scenario):
    held, line = scenario(tmp_path / name)
    assert held, line
    assert "\n" not in line and "NO" not in line.split(": ", 1)[1]
