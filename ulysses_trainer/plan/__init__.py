"""The plan: every setting of a run decided once (resolve), from the memory model and the step-time model."""
