"""The frontend: ``torch.export`` of a Hugging Face decoder into an fx graph, and the ladder of
export settings that gets one from any model (the trace is reused for every run).
"""
