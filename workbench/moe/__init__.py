"""Router, experts, dispatchers and the MoE block."""
