"""`auto`'s forecast when the backtest cannot tell the best laws apart: a blend weighted by their evidence.

Why a blend and not the winner alone: on many ladders two or three laws backtest about as well as each other
(on the public suite's Porian targets the second-best expected error is within 10% of the best on 45% of them,
within 2x on 86%; on Epoch's Chinchilla points within 2% on all ten), and which one "wins" is then a coin toss
that decides the forecast. Picking one law hides
that the ladder does not choose; averaging the laws the evidence cannot separate is the classic remedy
(Bayesian model averaging with the backtest as the likelihood), and its band admits the disagreement.

How:
- members: the scored, not excluded candidates of `forecasting.selection.select_method` whose expected error
  at the target's distance is within `WITHIN` times the best one's (a law the ladder's own backtest shows
  clearly worse gets no weight), at most `MAX_MEMBERS`, and in the point none whose weight would be under `MIN_WEIGHT`;
- weights proportional to expected_error^-k, with k the larger of 2 and the independent errors (held-out model
  sizes) the members' backtests share. The expected error is the backtest's RMS error per unit distance times
  the target's distance, times the small-sample factor of the held-out sizes it was measured on. With k
  independent errors of scale sigma the backtest's likelihood of a law is proportional to sigma^-k (pseudo
  Bayesian model averaging: weights from each law's held-out predictive density, Yao et al. 2018), so the more
  sizes the backtest held out, the more a small lead in error counts; with one or two sizes the weights are the
  inverse-variance ones (Bates and Granger). Why not inverse variance throughout: it weighs laws as if they were
  independent noisy estimates of one truth, and where the backtest held out many sizes it kept about half of the
  weight on laws that had missed them by more (public suite, Porian's configurations, six to ten held-out sizes:
  2.48% -> 2.18% mean abs error, BENCHMARKS.md);
- the band's disagreement is not weighed as the point is: the same close laws at inverse variance (k = 2), none
  dropped. The sharp weights read the backtest's errors as the target's, but those were measured at the backtest's
  distances, and a law that lost there by a little can still be right where the laws part: on the public suite's
  Epoch points two steps out, twelve held-out sizes gave Chinchilla's law 0.98 of the weight over the over-training
  law (0.41% against 0.56% expected), and at the under-trained largest sizes it missed by -4.6% to -5.8% where
  over-training missed by -0.5% to -2.1%, outside a +-2% band on 7 of 10 targets. So the point and the members' own
  bands keep the evidence's weights, and the band adds every close law's disagreement with the point at the
  inverse-variance ones. (Not the whole mixture at those weights: that also lends the weaker laws' own, often far
  wider, bands, and widened Porian's bands two steps out by 31% where they already held every target; BENCHMARKS.md.)
  A law with band weight alone leaves the forecast its chosen law's (`Forecast.method`), its `law` saying "band over";
- when nothing could be backtested (`no_evidence` in the selection: three rungs, say), the laws that could be
  fitted, with equal weights: with no evidence between them, the equal-weight average is the combination that
  is hard to beat (the "forecast combination puzzle", Claeskens et al. 2016), and it keeps their disagreement in
  the band instead of letting a fixed order of preference decide the forecast;
- the blend at each step of any member's curve, in log space: mean = sum w_i log p_i, and a variance that is the
  mixture's, sum w_i sigma_i^2 + sum b_i (log p_i - mean)^2, with sigma_i each member's own 95% band read back as
  a log-normal sigma and b_i the band's weights (w_i where they are the same). So the blend's band never loses a
  member's uncertainty and widens when they disagree. At a
  step outside a member's curve (before its first point, or anywhere but the end for a final-only forecast) that
  member has no say and the others' weights are renormalised: a final law draws its curve only from half the
  rungs' first eval on, matched progress from a thousandth of the run, and where the chosen law was a final law
  the blend used to start where it did, every eval before it read as the blend's first point held flat (Marin's
  hero at 0.8% of its run: -13.4% where matched progress alone was -6.7%).
"""

from __future__ import annotations

import numpy as np

from forecasting.forecast import Z95, BacktestResult, CurvePoint, Forecast, log_sigma

WITHIN = 2.0
MAX_MEMBERS = 4
MIN_WEIGHT = 0.01
MIN_EVIDENCE_POWER = 2


def members(selection: list[dict], chosen: str, *, band: bool = False) -> dict[str, float]:
    """{method: weight} of the laws to blend ({chosen: 1.0} when nothing else is close enough). With `band`, the
    weights of their disagreement in the band: the same close laws at inverse variance (power MIN_EVIDENCE_POWER),
    none dropped."""
    scored = [c for c in selection if c.get("expected_error") is not None and not c.get("excluded")]
    if not scored:
        alike = [c["method"] for c in selection if c.get("no_evidence")]
        if chosen not in alike:
            return {chosen: 1.0}
        picked = [chosen] + [m for m in alike if m != chosen][: MAX_MEMBERS - 1]
        return {m: 1.0 / len(picked) for m in picked}
    best = min(max(float(c["expected_error"]), 1e-6) for c in scored)
    close = sorted((c for c in scored if float(c["expected_error"]) <= WITHIN * best), key=lambda c: c["expected_error"])
    close = close[:MAX_MEMBERS]
    if chosen not in {c["method"] for c in close}:
        return {chosen: 1.0}
    shared = min(int(c.get("independent_errors") or 1) for c in close)
    power = MIN_EVIDENCE_POWER if band else max(MIN_EVIDENCE_POWER, shared)
    # relative to the best, so that a high power cannot underflow
    picked = {c["method"]: (best / max(float(c["expected_error"]), 1e-6)) ** power for c in close}
    if not band:
        total = sum(picked.values())
        picked = {m: w for m, w in picked.items() if w / total >= MIN_WEIGHT or m == chosen}
    total = sum(picked.values())
    return {m: w / total for m, w in picked.items()}


def _log_band(f: Forecast, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log of the prediction, log-normal sigma of the 95% band, whether `f` speaks there) at `steps`: a forecast
    speaks from its curve's first step to its last, and a final-only one at the final step alone (band_at would
    hold its ends flat elsewhere, which is no prediction)."""
    band = np.array([f.band_at(int(s)) for s in steps], dtype=float).reshape(-1, 3)
    if len(f.curve) >= 2:
        speaks = (steps >= f.curve[0].step) & (steps <= f.curve[-1].step)
    else:
        speaks = steps >= steps[-1]
    return np.log(band[:, 0]), log_sigma(band[:, 1], band[:, 2]), speaks


def blend(forecasts: dict[str, Forecast], weights: dict[str, float], band_weights: dict[str, float] | None = None) -> Forecast:
    """One forecast from several of the same target (the first is the reference for steps, target and fields): its
    point and the members' own bands from `weights`, the members' disagreement with that point at `band_weights`
    (`members(..., band=True)`; default `weights`). A member with band weight alone widens the band by its
    disagreement and moves no point."""
    band_weights = band_weights or weights
    names = [m for m in forecasts if weights.get(m, 0.0) > 0 or band_weights.get(m, 0.0) > 0]
    if len(names) == 1:
        return forecasts[names[0]]
    ref = forecasts[names[0]]
    w, wb = (np.array([x.get(m, 0.0) for m in names], dtype=float) for x in (weights, band_weights))
    w, wb = w / w.sum(), wb / wb.sum()
    points = {p.step: p for m in names for p in forecasts[m].curve}  # one target: a step's tokens are every member's
    steps = np.array(sorted(points) or [ref.target.steps()], dtype=float)
    logs, sigmas, speaks = zip(*(_log_band(forecasts[m], steps) for m in names), strict=True)
    lp, ls = np.array(logs), np.array(sigmas)
    # per step, the weights of the members that speak there (every step is on some member's curve); where no member
    # with point weight speaks, the band's weights place the point too
    speak = np.array(speaks, dtype=float)
    wbs = _per_step(wb, speak, speak)
    ws = _per_step(w, speak, wbs)
    mean = np.sum(ws * lp, axis=0)
    sigma = np.sqrt(np.sum(ws * ls**2 + wbs * (lp - mean) ** 2, axis=0))
    pred, lo, hi = np.exp(mean), np.exp(mean - Z95 * sigma), np.exp(mean + Z95 * sigma)
    curve = [CurvePoint(step=int(s), tokens=points[int(s)].tokens, flops=points[int(s)].flops, loss=float(a), lo=float(b),
                        hi=float(c)) for s, a, b, c in zip(steps, pred, lo, hi, strict=True)] if points else []
    spread = float(np.sqrt(wbs[:, -1] @ (lp[:, -1] - mean[-1]) ** 2))
    backtests: list[BacktestResult] = [b for m in names for b in forecasts[m].backtest]
    warn = [x for m in names for x in forecasts[m].warnings]
    point = [(m, x) for m, x in zip(names, w, strict=True) if x > 0]
    law = (" + ".join(f"{x:.2f} x {m} [{forecasts[m].law}]" for m, x in point) if len(point) > 1 else forecasts[point[0][0]].law)
    if not np.allclose(w, wb):
        law += "; band over " + " + ".join(f"{x:.2f} x {m}" + ("" if weights.get(m) else f" [{forecasts[m].law}]")
                                          for m, x in zip(names, wb, strict=True))
    return Forecast(
        target=ref.target, method="blend" if len(point) > 1 else point[0][0], inputs_fingerprint=ref.inputs_fingerprint,
        curve=curve, final_loss=float(pred[-1]), final_loss_lo=float(lo[-1]), final_loss_hi=float(hi[-1]), level=ref.level,
        law=law, params=_params(forecasts, names, [m for m, _ in point]), backtest=backtests,
        band_terms={"members_total": float(np.sqrt(ws[:, -1] @ ls[:, -1] ** 2)), "disagreement": spread, "total": float(sigma[-1])}
        | {f"weight.{m}": float(x) for m, x in zip(names, w, strict=True)}
        | {f"band_weight.{m}": float(x) for m, x in zip(names, wb, strict=True)},
        warnings=list(dict.fromkeys(warn)),
    )


def _params(forecasts: dict[str, Forecast], names: list[str], point: list[str]) -> dict:
    """The members' parameters, each prefixed with its law's name; a forecast whose point is one law's keeps that
    law's unprefixed (its method is that law), and only the laws in its band alone are prefixed."""
    return {(k if len(point) == 1 and m == point[0] else f"{m}.{k}"): v for m in names for k, v in forecasts[m].params.items()}


def _per_step(w: np.ndarray, speak: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Weights (members x steps) renormalised over the members that speak at each step; `fallback` where none of
    the weighted ones does."""
    ws = w[:, None] * speak
    total = ws.sum(axis=0)
    return np.where(total > 0, ws / np.where(total > 0, total, 1.0), fallback / fallback.sum(axis=0))
