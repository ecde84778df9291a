"""Data: sources -> canonical JSONL, checks, pictures, the synthetic set, box-true augmentation."""
