"""Tensor parallelism (Megatron-style) for the Llama family, at the model's layer (imports
model and kernels only): which rows and columns each rank keeps (sharding.py), the collectives
(collectives.py), the sharded model (model.py) and its loading from a Hugging Face folder
(loader.py). The processes that run the shards, and the adapters' shards, live in
loraplex/worker/."""
