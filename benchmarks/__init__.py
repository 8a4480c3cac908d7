"""clis_bench: measuring and reporting helpers shared by scripts/ and notes/experiments/ (installed from
this folder; `results/` beside it holds the committed figures' raw JSON)."""
