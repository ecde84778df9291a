"""The deploy wing: a run's model exported (export.py, its model card cards.py, the hub push
hub.py; onnx_export.py and the standalone onnx_predict.py, which ships inside ONNX exports) and
served over HTTP (serve.py, with reading.py, chat.py and limits.py, on batching.py)."""
