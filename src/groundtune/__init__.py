"""groundtune: fine-tune Qwen-VL models for visual grounding (image + phrase -> bounding box)."""

__version__ = "0.1.0"
