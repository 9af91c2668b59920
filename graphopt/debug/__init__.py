"""What ``graphopt debug`` builds on, beyond the PassManager's instruments.

- ``bisect``: find the first pass, then the first single rewrite, that breaks numerics,
  by bisecting the global rewrite counter (LLVM's ``-opt-bisect-limit``).
- ``graph_source``: an FX graph as Python source and back (reproducers never pickle).
- ``reproducer``: write a failing pass's input graph, inputs and pipeline (``WriteReproducer``, the
  instrument that does it when a pass fails); replay it.
- ``graph_view``, ``svg_layout``, ``dot``, ``html_report``: the self-contained HTML page.
"""
