"""The plan's vocabulary: what the runtime code (attention/, levers/, parallel/, a family's torch side), the config's
checks and the model read of the plan, below all of them: names (kernel names and shape rules), layout
(world = dp x sp), lever_settings (the memory levers decoded once), model_setup (what parallelize installs).
Torch-free; it imports nothing of the package but errors (tests/test_import_graph.py holds it to that)."""
