"""The trainer: run set-up, the loop, checkpoints, metrics, signals, exports of a run."""
