"""Goodness of fit for the sampling tests: Pearson's chi-squared, no scipy needed."""
import math

import numpy as np


def chi2_pvalue(observed, probs, min_expected: float = 5.0) -> float:
    """P(chi-squared >= the statistic) for ``observed`` counts against ``probs``.

    Cells whose expected count is below ``min_expected`` are pooled with their
    neighbours (in order) so that the approximation holds.  The tail uses the
    Wilson-Hilferty cube-root normal approximation, accurate to a few percent
    of the p-value in the range the tests look at.  Observations in a cell of
    probability 0 give p = 0.
    """
    observed = np.asarray(observed, np.float64)
    probs = np.asarray(probs, np.float64)
    if observed[probs == 0].sum() > 0:
        return 0.0
    n = observed.sum()
    obs_cells, exp_cells, o, e = [], [], 0.0, 0.0
    for oc, pc in zip(observed[probs > 0], probs[probs > 0] / probs.sum()):
        o, e = o + oc, e + pc * n
        if e >= min_expected:
            obs_cells.append(o)
            exp_cells.append(e)
            o = e = 0.0
    if e and exp_cells:
        obs_cells[-1] += o
        exp_cells[-1] += e
    obs_cells, exp_cells = np.array(obs_cells), np.array(exp_cells)
    df = len(exp_cells) - 1
    if df < 1:
        return 1.0
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
