"""Experiment trackers a run reports its step records to (train.report_to): TensorBoard, Weights & Biases, MLflow.

One small module per tracker, each using that tracker's own library (the `trackers` pip extra), all writing inside
the run's folder with no network: registry.py names them and what they need installed (read by the config check),
reporter.py is the callback the trainer adds on rank 0, scalars.py turns a step record into the numbers they log.
"""
