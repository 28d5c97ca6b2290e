"""ONNX: the patch baked into ``model.onnx``, the patchable model and onnxruntime adapters, each
checked in onnxruntime.
"""
