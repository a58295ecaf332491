"""The plan: every setting of a run decided once (resolve), from the memory model and the step-time model.

Its vocabulary, which the config checks, the model and the runtime code read (tests/test_import_graph.py holds
them to it): names (kernel names and shape rules), layout (world = dp x sp), lever_settings (the memory levers
decoded once), model_plan (what parallelize installs). The plan imports nothing above the model families."""
