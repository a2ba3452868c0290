"""The ``comlrl`` command line: train from a YAML config, list and verify checkpoints, export the
agents, plot a run (docs/cli.md).

    comlrl train run.yaml [--num_train_epochs 4 --resume auto ...]
    comlrl checkpoints runs/x
    comlrl export runs/x/checkpoint-2 final --config run.yaml [--merge]
    comlrl plot runs/x

Also ``python -m comlrl``; under ``torchrun`` every process runs the same command.
"""

from .main import main

__all__ = ["main"]
