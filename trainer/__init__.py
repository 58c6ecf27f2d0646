"""The shared JAX MoE trainer: every rung and the hero run through `trainer.train(job, run_dir)`."""
