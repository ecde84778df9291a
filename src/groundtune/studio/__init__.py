"""The studio: `groundtune studio`, the whole journey in a browser (docs/studio.md).

app.py (the app, its table of endpoints, the page), safety.py (what a page may read and who may
ask), jobs.py (the train/rl/eval/check processes it starts), and a module per tab: data.py,
launch.py, watch.py, judge.py, tryout.py. Nothing heavy is imported here: the command line builds
its parser without FastAPI or torch."""
