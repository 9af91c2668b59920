"""``graphopt export``: a model -> an optimized model file, proven against eager. An
application of the core: the compile front half optimizes, the export target's ``exporter``
(found through the registry) lowers and runs the file; nothing here imports a backend.

- ``model``: the single-graph export (``export_model``, ``optimize_and_export``) and the
  ``Exporter`` protocol a target lends;
- ``files``: the stage timer, destination checks, the atomic save, what each file is made of;
- ``validate``: the file run in its runtime against eager on two shapes, top-1 agreement.
"""
