"""The worker processes: one per tensor-parallel rank (per GPU), each holding its shard of the
model, its KV cache and its adapter slots, running each step a driver sends (process.py);
the driver's side (workers.py); the messages that cross, one file each way (commands.py,
replies.py). Nothing else crosses the process boundary."""
