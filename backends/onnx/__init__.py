"""onnx."""
