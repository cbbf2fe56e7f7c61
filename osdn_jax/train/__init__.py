"""Training: named configs, the optimiser, the chunked loss, the mesh, checkpoints, metrics and the loop.

    python -m osdn_jax.train --config=tiny --workdir=/tmp/run             # CPU, about a minute
    python -m osdn_jax.train --config=340m --config.model=pgdn-340m --workdir=runs/pgdn   # one GPU or several
    python -m osdn_jax.train --config=mqar --config.model=pdn-mqar --workdir=runs/mqar    # zoology's MQAR
"""
from osdn_jax.train.configs import get_config, validate
from osdn_jax.train.loop import (NonFiniteError, TrainResult, TrainSetup, WorkdirLockedError, load, load_checkpoint,
                                 run, setup, train, train_loop)

__all__ = ["NonFiniteError", "TrainResult", "TrainSetup", "WorkdirLockedError", "get_config", "load", "load_checkpoint",
           "run", "setup", "train", "train_loop", "validate"]
