"""The engine every trainer family shares (internal): inputs, prompts, episodes, the update step,
the epoch loop, metrics. A family is its algorithm on :class:`comlrl.engine.trainer.Trainer`."""
