"""``metrics.mcmc.effective_sample_size`` (one chain ``[n, d]``): ArviZ's bulk ESS, against the
closed form of an AR(1) process and against ArviZ called directly."""
import warnings

import numpy as np
import pytest

from metrics.mcmc import effective_sample_size

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import arviz as az


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_ess_of_an_ar1_process_is_n_times_1_minus_rho_over_1_plus_rho(rho):
    rng = np.random.default_rng(0)
    n, d = 20000, 4
    x = np.zeros((n, d))
    noise = rng.normal(size=(n, d)) * np.sqrt(1 - rho**2)
    x[0] = rng.normal(size=d)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + noise[t]
    expected = n * (1 - rho) / (1 + rho)
    ess = effective_sample_size(x)
    assert ess.shape == (d,)
    np.testing.assert_allclose(ess, expected, rtol=0.15)
    assert ess[1] == az.ess(x[None, :, 1], method="bulk")


def test_constant_series_and_short_inputs():
    assert effective_sample_size(np.ones((10, 2))).tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="at least 4 draws"):
        effective_sample_size(np.zeros(3))
