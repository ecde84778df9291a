"""The deploy wing: a run's model exported (export.py, cards.py, hub.py; onnx_export.py and the
standalone onnx_predict.py) and served over HTTP (serve.py on batching.py)."""
