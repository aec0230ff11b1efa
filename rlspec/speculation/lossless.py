"""The two-sample test the lossless checks use: were two samples of one position's token drawn
from the same distribution? (tests/speculation/test_lossless.py states the power; make gpu-check
runs the same test on a GPU.)"""
from __future__ import annotations

from collections import Counter


def two_sample_p(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test of homogeneity of two samples of token ids: a 2 x K contingency table of
    counts, tokens whose pooled count is under min_count merged into one column. 1.0 when fewer
    than two columns remain."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    big = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    rows = [[c[t] for t in big] + [sum(c.values()) - sum(c[t] for t in big)] for c in (ca, cb)]
    cols = [j for j in range(len(rows[0])) if rows[0][j] + rows[1][j] > 0]
    if len(cols) < 2:
        return 1.0
    return float(chi2_contingency([[r[j] for j in cols] for r in rows], correction=False)[1])
