# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""Small exact statistics for the sanity benchmark's seed counts (no SciPy needed; tests/unit/test_sanity_stats.py).

- `fisher_exact`: Fisher's exact test on a 2×2 table (collapsed / not collapsed, method A / method B);
- `clopper_pearson`: the exact binomial 95% interval of a collapse rate;
- `wilson`: the Wilson score interval (reported next to it where a closed form is handier);
- `newcombe_diff`: Newcombe's hybrid-score 95% interval of a difference of two proportions (from two Wilson intervals);
- `mcnemar_exact`: the exact McNemar test on paired binary outcomes (the discordant pairs);
- `holm`: Holm–Bonferroni adjusted p-values for a family of comparisons;
- `mean_se`: mean and standard error (sample s.d. / √n).
"""

from __future__ import annotations

import math
from statistics import NormalDist

__all__ = ["clopper_pearson", "fisher_exact", "holm", "mcnemar_exact", "mean_se", "newcombe_diff", "wilson"]

# Tables whose probability is within this relative margin of the observed one count as "as extreme" (SciPy's rule:
# it keeps floating-point ties of symmetric tables in the two-sided p).
_TIE = 1 + 1e-7


def _hypergeom_pmf(k: int, k_total: int, n_a: int, n_b: int) -> float:
    """P(A has k of the k_total events) when A has n_a trials and B n_b, margins fixed."""
    return math.comb(n_a, k) * math.comb(n_b, k_total - k) / math.comb(n_a + n_b, k_total)


def fisher_exact(a: int, n_a: int, b: int, n_b: int, alternative: str = "two-sided") -> float:
    """Fisher's exact p for `a` events in `n_a` trials against `b` in `n_b`.

    `alternative`: "two-sided" (sum over tables no more likely than the observed one), "less" (A's rate below B's)
    or "greater".
    """
    if not (0 <= a <= n_a and 0 <= b <= n_b) or n_a + n_b == 0:
        raise ValueError(f"fisher_exact: need 0 <= a <= n_a and 0 <= b <= n_b, got {a}/{n_a} and {b}/{n_b}.")
    k_total = a + b
    lo, hi = max(0, k_total - n_b), min(n_a, k_total)
    pmf = {k: _hypergeom_pmf(k, k_total, n_a, n_b) for k in range(lo, hi + 1)}
    if alternative == "less":
        p = sum(v for k, v in pmf.items() if k <= a)
    elif alternative == "greater":
        p = sum(v for k, v in pmf.items() if k >= a)
    elif alternative == "two-sided":
        p = sum(v for v in pmf.values() if v <= pmf[a] * _TIE)
    else:
        raise ValueError(f"fisher_exact: alternative={alternative!r}; use 'two-sided', 'less' or 'greater'.")
    return min(1.0, p)


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))


def _bisect(f, target: float, increasing: bool) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(200):  # far below float resolution
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper–Pearson) interval of a binomial proportion k/n."""
    if not (0 <= k <= n and n > 0):
        raise ValueError(f"clopper_pearson: need 0 <= k <= n and n > 0, got {k}/{n}.")
    alpha = 1 - confidence
    # Lower: P(X >= k | p) = alpha/2, i.e. cdf(k-1) = 1 - alpha/2 (cdf falls as p rises).
    lower = 0.0 if k == 0 else _bisect(lambda p: _binom_cdf(k - 1, n, p), 1 - alpha / 2, increasing=False)
    # Upper: P(X <= k | p) = alpha/2.
    upper = 1.0 if k == n else _bisect(lambda p: _binom_cdf(k, n, p), alpha / 2, increasing=False)
    return lower, upper


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n."""
    if not (0 <= k <= n and n > 0):
        raise ValueError(f"wilson: need 0 <= k <= n and n > 0, got {k}/{n}.")
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_diff(a: int, n_a: int, b: int, n_b: int, confidence: float = 0.95) -> tuple[float, float]:
    """Interval of a/n_a − b/n_b: Newcombe's hybrid score method (1998, method 10), from the two Wilson intervals."""
    p_a, p_b = a / n_a, b / n_b
    lo_a, hi_a = wilson(a, n_a, confidence)
    lo_b, hi_b = wilson(b, n_b, confidence)
    d = p_a - p_b
    return (
        d - math.sqrt((p_a - lo_a) ** 2 + (hi_b - p_b) ** 2),
        d + math.sqrt((hi_a - p_a) ** 2 + (p_b - lo_b) ** 2),
    )


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p: `only_a` pairs where only A had the event, `only_b` where only B had it."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def holm(pvalues: list[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the input order (monotone, capped at 1)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None for fewer than 2 values)."""
    if not values:
        raise ValueError("mean_se: no values.")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)
