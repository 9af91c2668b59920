"""The ``torch.compile`` target's strategies across a model's graphs (``target.py`` uses them).

- ``lazy_build``: a static recompile runs on torch first and builds its session at its second call.
- ``reuse``: a recompiled graph that is an instance of an earlier dynamic one runs on its session.
- ``placement``: which nodes ONNX Runtime can take, and an order that keeps each side together.
"""
