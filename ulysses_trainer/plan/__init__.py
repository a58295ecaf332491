"""The plan: every setting of a run decided once (resolve), from the memory model and the step-time model.

What the config checks, the model and the runtime code read of it (its vocabulary: kernel names and shape rules,
the layout, the levers decoded once, the ModelSetup) lives below it, in vocabulary/. The plan reads the families'
torch-free facts and the vocabulary, nothing of the model, the data or the runtime code."""
