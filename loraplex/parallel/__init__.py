"""Tensor parallelism (Megatron-style) for the Llama family: which rows and columns each rank
keeps (sharding.py), the collectives (collectives.py), the sharded model (model.py), its
loading from a Hugging Face folder (loader.py) and the adapters' shards (adapters.py). The
processes that run the shards live in loraplex/worker/."""
