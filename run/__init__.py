"""The run plumbing the training scripts share: processes, devices, checkpoints, FSDP, the start."""
