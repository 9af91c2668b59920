"""What the onnxruntime target lends ``graphopt export`` (graphopt/export): an optimized graph
lowered to an ONNX model with ORT's fused ops, and an ONNX Runtime session to check the written
file. No pass runs here: the core's front half optimized the graph before it comes in."""

from __future__ import annotations

from typing import Sequence

from graphopt.backends.onnxruntime.errors import OnnxExportError
from graphopt.errors import GraphoptError
from graphopt.export.validate import first_line


class OnnxExporter:
    runtime = "ONNX Runtime"

    def lower(self, optimized, *, axis_names: Sequence[dict[int, str] | None], input_names: Sequence[str],
              output_names: Sequence[str] | None = None, opset: int | None = None):
        """``optimized`` (graphopt.compiler.Optimized) -> an OnnxModel, its trace's notes kept."""
        from graphopt.backends.onnxruntime.lower.export import export_graph

        # No onnxscript pattern rewrites, as for the sessions graphopt builds itself: on SmolLM2-135M
        # they took 20 of the export's 24 s, and every runtime's loader optimizes the graph
        # anyway. The attention layout tidy-up and constant folding leave fewer nodes than they
        # did (513 against 1816), with the same outputs.
        model = export_graph(optimized.gm, optimized.example_inputs, opset=opset, input_names=input_names,
                             output_names=output_names, axis_names=axis_names, tidy_attention=True)
        model.notes = list(optimized.program.notes)
        return model

    def pass_records(self, model) -> list:
        """The ONNX-level passes the lowering ran on ``model`` (onnx_passes/runner.py), as the
        report's PassRecords: they follow the FX passes in the export's records."""
        return list(model.passes.records)

    def pass_near_misses(self, model) -> list:
        """Where those passes stopped short (report.NearMiss, named ``onnx:<pass>``)."""
        return list(model.passes.near_misses)

    def lower_graph(self, gm, example_inputs):
        """An optimized graph with concrete inputs -> its OnnxModel at their shapes, as a static
        session build exports it (``graphopt debug --target onnxruntime`` shows its passes). Its
        passes end with the rewrite a CPU session's bytes get (``onnx:transposed_weights``), run
        on bytes made as for one and dropped, so the listing has every ONNX pass a compiled graph
        gets; no session is opened."""
        import onnxruntime

        from graphopt.backends.onnxruntime.lower.export import export_graph
        from graphopt.backends.onnxruntime.runtime.weights_in_memory import serialize_sharing_weights

        model = export_graph(gm, list(example_inputs), dynamic=False, tidy_attention=True)
        model.passes.extend(serialize_sharing_weights(model, onnxruntime.SessionOptions())[2])
        return model

    def open(self, path: str, provider: str):
        """A runner on the written file: ``runner(*inputs) -> list of tensors``."""
        from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session

        try:
            return SessionRunner(create_session(path, provider))
        except GraphoptError:
            raise
        except Exception as error:  # ORT's own errors: one line, and where the file is
            raise OnnxExportError(f"ONNX Runtime cannot load {path}: {first_line(error)}") from error


onnx_exporter = OnnxExporter()
