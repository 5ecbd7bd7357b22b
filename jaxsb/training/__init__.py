"""Training: the loop (`trainer.py`), the run's workdir, state building (`state.py`), one step
and its update (`step.py`, shared by rows and planned steps), how each step is prepared
(`steps.py`), per-step planning and program admission (`planning.py`), checkpoints, metrics
and the optimiser."""
