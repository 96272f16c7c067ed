"""MeshConfig -> DeviceMesh with named dims for dense parameters and for experts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshError(ValueError):
    """A mesh that does not fit the world size or the model."""


@dataclass(frozen=True)
class MeshConfig:
    """Data parallel x expert parallel layout of the ranks.

    `dp` spans the whole world (expert parallelism lives inside data parallelism, as NeMo
    AutoModel's ep=8, dp=8 on 8 GPUs); experts are split over `ep` consecutive ranks and
    replicated over the expert-data-parallel dim `edp = dp // ep`. `cp` and `tp` are reserved
    (must be 1) so the API can grow without breaking.
    """

    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "ep", "cp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"MeshConfig.{name} must be a positive integer, got {value!r}")
        if self.cp != 1 or self.tp != 1:
            raise MeshError("context and tensor parallelism are not supported yet: keep cp=1 and tp=1")
        if self.dp % self.ep:
            raise MeshError(
                f"ep={self.ep} must divide dp={self.dp}: experts are split inside data "
                f"parallelism; try ep in {divisors(self.dp)}"
            )

    @property
    def world_size(self) -> int:
        """Ranks the mesh spans."""
        return self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: how many copies of each expert exist."""
        return self.dp // self.ep

    def validate(self, world_size: int, num_experts: int | None = None) -> None:
        """Refuse a mesh that does not match the world size or split the experts evenly."""
        if self.world_size != world_size:
            raise MeshError(
                f"MeshConfig(dp={self.dp}, ep={self.ep}) spans {self.world_size} ranks but the "
                f"world has {world_size}; use dp={world_size} and an ep in {divisors(world_size)}"
            )
        if num_experts is not None and num_experts % self.ep:
            good = [d for d in divisors(world_size) if num_experts % d == 0]
            raise MeshError(
                f"ep={self.ep} does not divide the model's {num_experts} experts (uneven experts "
                f"per rank are refused); choose ep in {good}"
            )

    def ep_rank_of(self, rank: int) -> int:
        """Position of a global rank inside its expert-parallel group."""
        return rank % self.ep

    def expert_range(self, rank: int, num_experts: int) -> tuple[int, int]:
        """[first, last) experts that `rank` owns."""
        per_rank = num_experts // self.ep
        first = self.ep_rank_of(rank) * per_rank
        return first, first + per_rank

    def build(self, device_type: str = "cpu") -> DeviceMesh:
        """A DeviceMesh with dims ("edp", "ep") and the flattened dense dim "dp"."""
        if not dist.is_initialized():
            raise MeshError(
                "MeshConfig.build() needs an initialized process group "
                "(torchrun, workbench.Cluster, or torch.distributed.init_process_group)"
            )
        self.validate(dist.get_world_size())
        mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=("edp", "ep"))
        mesh["edp", "ep"]._flatten("dp")
        return mesh

    def to_dict(self) -> dict[str, int]:
        """Plain mapping of every field."""
        return dataclasses.asdict(self)


def dense_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The flattened ("edp", "ep") dim that dense parameters and data parallelism use.

    Flattening again returns the mesh `build()` made (torch keeps it by name); slicing the root
    mesh by "dp" does too, but torch deprecates slicing a flattened dim from the root.
    """
    return device_mesh["edp", "ep"]._flatten("dp")


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_meshes(world_size: int, num_experts: int) -> list[MeshConfig]:
    """Every dp x ep layout that fits `world_size` ranks and `num_experts` experts."""
    return [MeshConfig(dp=world_size, ep=ep) for ep in divisors(world_size) if num_experts % ep == 0]
