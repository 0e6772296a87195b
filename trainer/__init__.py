"""Training: dense models, pooling, the training loop with its push queue and fresh rows,
dense sync across ranks, job checkpoints, progressive metrics, the dense weights published
for serving, and a plain PyTorch reference loop as the test oracle."""
