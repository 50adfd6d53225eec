"""How many prompts a regression-rate gate needs: the table in docs/verdicts.md.

For ``thresholds.max_regression_rate`` (the run fails when the Wilson lower bound of
regressions / comparable prompts exceeds it) and a true regression rate above it, the fewest
prompts at which the run fails with probability >= --power. Computed exactly, no simulation:
for each n, ``regress.stats.fails_from`` finds the fewest regressions k whose Wilson lower bound
(scipy's ``binomtest(k, n).proportion_ci(method="wilson")``) exceeds the limit, and
``scipy.stats.binom.sf(k - 1, n, true_rate)`` is the probability of at least that many, prompts
regressing independently. That probability is a saw-tooth in n; the table gives the smallest n
from which it stays >= --power (checked up to n + n/4). The last columns show the other side:
how many regressions of a 127-prompt set (the demo) and a 1,000-prompt set fail the run.

Usage: python benchmarks/sample_size_table.py [--max-rate 0.01] [--true-rates 0.02 0.03 0.05]
       [--power 0.8] [--confidence 0.95]
"""

from __future__ import annotations

import argparse

from regress.stats import failure_probability, fails_from, prompts_needed


def _p(value: float) -> str:
    return "> 99 %" if value > 0.995 else "< 1 %" if value < 0.005 else f"{value * 100:.0f} %"


def table(max_rate: float, true_rates: list[float], power: float, confidence: float) -> str:
    pct = f"{max_rate * 100:g} %"
    lines = [f"| true regression rate | prompts for P(fail) ≥ {power * 100:g} % (`max_regression_rate: {max_rate:g}`) "
             f"| P(fail) at 127 prompts | P(fail) at 1,000 prompts |",
             "|---:|---:|---:|---:|"]
    for rate in true_rates:
        n = prompts_needed(max_rate, rate, power=power, confidence=confidence)
        shown = "—" if n is None else f"{n:,}"
        lines.append(f"| {rate * 100:g} % | {shown} | {_p(failure_probability(127, rate, max_rate, confidence))} "
                     f"| {_p(failure_probability(1000, rate, max_rate, confidence))} |")
    k127, k1000 = fails_from(127, max_rate, confidence), fails_from(1000, max_rate, confidence)
    lines.append("")
    lines.append(f"At {confidence * 100:g} % confidence and a limit of {pct}, a run fails from {k127} regressions "
                 f"of 127 prompts and from {k1000} of 1,000; a candidate whose true rate is exactly {pct} "
                 f"fails {_p(failure_probability(127, max_rate, max_rate, confidence))} of the time at 127 prompts "
                 f"and {_p(failure_probability(1000, max_rate, max_rate, confidence))} at 1,000 (false alarms).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rate", type=float, default=0.01)
    parser.add_argument("--true-rates", type=float, nargs="+", default=[0.01, 0.02, 0.03, 0.05])
    parser.add_argument("--power", type=float, default=0.8)
    parser.add_argument("--confidence", type=float, default=0.95)
    args = parser.parse_args()
    print(table(args.max_rate, args.true_rates, args.power, args.confidence))


if __name__ == "__main__":
    main()
