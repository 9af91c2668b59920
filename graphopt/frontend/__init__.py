"""Frontends: a model or a dynamo graph -> the ATen FX graph every pass sees.

- ``trace``: the two entry points, ``compile_dynamo_graph`` (torch.compile: aot_autograd
  on dynamo's graph) and ``export_aten_graph`` (torch.export, for whole-model tools); both
  freeze weights into named constants;
- ``dynamic_floats``: float attributes (an RMSNorm's eps) stay constants under ``dynamic=True``;
- ``repeated_layers``: a stack of identical layers traced once, the rest stamped in as copies;
- ``dynamo_reuse``: dynamo's batch-1 retrace served by the code already compiled for the dynamic graph;
- ``graph_instance``: the proof behind that reuse: one graph is another with some sizes fixed.
"""
