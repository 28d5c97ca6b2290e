"""llama.cpp itself: a GGUF run in a child process (libllama aborts on bad input), and the check of
an artefact against llama.cpp's own full-context run."""
