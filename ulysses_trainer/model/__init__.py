"""Model building, presets and the one `parallelize` entry point. Never calls collectives."""
