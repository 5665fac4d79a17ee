"""Who talks to whom: node names, prefill and decode groups, and per-room writer sets.

A *group* is one attention-TP group: a whole instance without DP attention, or one DP rank of
it with DP attention; a prefill group with ``pp_size > 1`` (Mooncake only) holds every
pipeline stage's attention-TP ranks. A room is served by one prefill group and one decode
group. Node ids are ``p{instance}g{dp}r{rank}`` and ``d{instance}g{dp}r{rank}``, and
``p{instance}g{dp}s{stage}r{rank}`` for a prefill rank of a deployment with ``pp_size > 1``;
a decode node id is also the session id prefill ranks use for its watermark (SGLang's agent
name).
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.core.config import TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.layout import pp_stage_of, target_decode_ranks

__all__ = ["Group", "Node", "Topology", "build_rank", "build_ranks", "node_id", "pp_stage_of"]
from twin.core.prefill import PrefillRank


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    role: str  # "prefill" | "decode"
    instance: int
    dp: int
    rank: int
    unique_rank: int
    pp_rank: int = 0

    @property
    def port(self) -> int:
        """The node's control port as the protocol sees it (SGLang's ``rank_port``, a free
        port bound at start-up): a fixed pseudo-random value per node id, so the transfer
        worker a room's destinations pick is as arbitrary as SGLang's and still reproducible."""
        h = 0x811C9DC5  # FNV-1a, 32 bits
        for byte in self.id.encode("ascii"):
            h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
        return 20000 + h % 40000


@dataclass(frozen=True, slots=True)
class Group:
    role: str
    instance: int
    dp: int
    nodes: tuple[Node, ...]


def node_id(role: str, instance: int, dp: int, rank: int, pp_rank: int | None = None) -> str:
    """``p0g1r2``; with a PP stage (a deployment with ``pp_size > 1``) ``p0g1s1r2``."""
    if pp_rank is None:
        return f"{role[0]}{instance}g{dp}r{rank}"
    return f"{role[0]}{instance}g{dp}s{pp_rank}r{rank}"


class Topology:
    """Groups of a deployment and the writer fan-in/fan-out between them."""

    def __init__(self, cfg: TwinConfig) -> None:
        self.cfg = cfg
        self.prefill_groups = self._groups("prefill")
        self.decode_groups = self._groups("decode")
        self.nodes: dict[str, Node] = {
            n.id: n for g in (*self.prefill_groups, *self.decode_groups) for n in g.nodes
        }

    def _groups(self, role: str) -> list[Group]:
        side = getattr(self.cfg, role)
        groups = []
        pp = side.pp_size
        for inst in range(side.instances):
            for dp in range(side.attn_dp_size):
                nodes = tuple(
                    Node(node_id(role, inst, dp, r, s if pp > 1 else None), role, inst, dp, r,
                         unique_rank=((inst * side.attn_dp_size + dp) * pp + s)
                         * side.attn_tp_size + r, pp_rank=s)
                    for s in range(pp) for r in range(side.attn_tp_size)
                )
                groups.append(Group(role, inst, dp, nodes))
        return groups

    def targets_of(self, prefill: Node, decode_group: Group) -> list[Node]:
        """Decode nodes of ``decode_group`` that prefill rank ``prefill`` writes to."""
        p, d = self.cfg.prefill.attn_tp_size, self.cfg.decode.attn_tp_size
        return [decode_group.nodes[i] for i in target_decode_ranks(p, d, prefill.rank)]

    def decode_group_of(self, node: Node) -> tuple[str, ...]:
        """Node ids of ``node``'s decode attention-TP group (whose polls SGLang reduces)."""
        return tuple(node_id("decode", node.instance, node.dp, r)
                     for r in range(self.cfg.decode.attn_tp_size))

    def writers_of(self, decode: Node, prefill_group: Group) -> tuple[str, ...]:
        """Prefill node ids of ``prefill_group`` writing into decode rank ``decode``."""
        p, d = self.cfg.prefill.attn_tp_size, self.cfg.decode.attn_tp_size
        return tuple(n.id for n in prefill_group.nodes
                     if decode.rank in target_decode_ranks(p, d, n.rank))


def build_rank(cfg: TwinConfig, node: Node, defects: Defects) -> PrefillRank | DecodeRank:
    """A fresh core for ``node`` (a prefill or a decode rank)."""
    if node.role == "prefill":
        return PrefillRank(cfg, node.id, node.rank, node.unique_rank, defects,
                           pp_rank=node.pp_rank)
    return DecodeRank(cfg, node.id, node.rank, defects, port=node.port)


def build_ranks(topo: Topology, defects: Defects) -> dict[str, PrefillRank | DecodeRank]:
    """A fresh core for every node of ``topo``, by node id."""
    return {n.id: build_rank(topo.cfg, n, defects) for n in topo.nodes.values()}
