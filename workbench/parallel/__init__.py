"""Device mesh, FSDP2 sharding, process groups and launching (below workbench.models: no model code here)."""
