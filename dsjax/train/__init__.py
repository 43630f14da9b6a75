"""Training: optimizer, functional steps, loop. `python -m dsjax.train --config configs/tiny.yaml`."""
