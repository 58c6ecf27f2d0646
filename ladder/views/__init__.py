"""What shows a ladder to a person: `ladder plot` (PNG and offline HTML), `ladder report`, `ladder watch`, `ladder serve`.

The views only read: the store, the run directories and the stored forecasts, through the rest of ladder
and forecasting. The import rule, checked by tests/test_ladder_views_layout.py: nothing in ladder/ below
the views imports them (only the entry points ladder.cli and ladder.demo do), and the views import each
other without a circle, sharing their pieces through views.common:

- common.py  the plot tables (PlotData), colours, axis names, band and axis-range helpers,
- plots.py   sources (experiment + store, a table, Marin's public ladder) -> PlotData, and `ladder plot`,
- png.py     the matplotlib renderer,   html.py   the offline SVG/HTML plotter,
- report.py  `ladder report` (one self-contained page),   watch.py  `ladder watch` (the terminal view),
- serve.py   `ladder serve` (the live page).
"""
