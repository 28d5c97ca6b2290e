"""Loading a model and reaching its weights: checkpoints and GGUF files, devices and offload,
lazy placement of weights, the model's fingerprint, vision-language models and their images.
"""
