"""forecasting: scaling-law fits with honest uncertainty, whole-curve forecasts, refits and backtests.

A pure numerical library (numpy, scipy, pandas) on a table of runs (see forecasting.table); it imports
nothing from ladder/ or trainer/. Entry points for users and the CLI are in forecasting.api.
"""

from forecasting.api import BacktestReport, LadderFit, backtest, fit_ladder, forecast_target, load_table, refit_forecast
from forecasting.forecast import Forecast, TargetSpec

__all__ = [
    "BacktestReport",
    "Forecast",
    "LadderFit",
    "TargetSpec",
    "backtest",
    "fit_ladder",
    "forecast_target",
    "load_table",
    "refit_forecast",
]
