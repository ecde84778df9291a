"""Models: loading (hub, local, run folder, tiny), Qwen specifics, adaptation plans."""
