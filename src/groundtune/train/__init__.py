"""Training stages: sft.py (supervised), checkpoint.py (run folders; their layout: groundtune/runs.py),
monitor.py (logs, stop, GPU)."""
