"""Training stages: sft.py (supervised), checkpoint.py (run folders), monitor.py (logs, stop, GPU)."""
