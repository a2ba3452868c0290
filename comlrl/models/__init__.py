"""Model wrappers: :mod:`comlrl.models.actor_critic` (a causal LM with a value head)."""
