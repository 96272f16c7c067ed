"""Device mesh, FSDP2 sharding, expert-parallel model building, activation checkpointing."""
