"""How close each artefact is to the full-context model, in the runtime that serves it."""
