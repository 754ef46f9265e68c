"""Length-aware dynamic CP's process groups (issue 32): the aligned groups of every power-of-two size the
planner (:mod:`seqpar.sequence.dynamic`) may choose, made once when the manager is built, never during a
step. :class:`seqpar.runtime.factory.ProcessGroupManager` inherits them; a micro-batch's plan names its
group by ``(size, index)`` and each swapped layer takes it from the call.

The pool of a TP rank set is its ``(dp, sp)`` grid flattened row-major (position ``dp_rank * sp + sp_rank``);
group ``(c, i)`` is positions ``[i c, (i + 1) c)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from seqpar.runtime.grid import dynamic_group_sizes

if TYPE_CHECKING:
    import torch

__all__ = ["DynamicGroups"]


class DynamicGroups:
    """Dynamic CP's groups, read from the class that mixes it in (``cube``, ``grid``, ``rank``, ``dp_size``,
    ``dp_rank``, ``sp_size``, ``sp_rank``, ``tp_size``, ``self_group``, ``sp_group``, ``sp_dp_group`` and
    ``_new_groups``); ``_dynamic_groups`` is set by :meth:`_make_dynamic_groups`' caller."""

    if TYPE_CHECKING:  # provided by the manager
        cube: torch.Tensor
        grid: torch.Tensor
        rank: int
        dp_size: int
        dp_rank: int
        sp_size: int
        sp_rank: int
        tp_size: int
        self_group: dist.ProcessGroup
        sp_group: dist.ProcessGroup
        sp_dp_group: dist.ProcessGroup
        _dynamic_groups: dict[int, dist.ProcessGroup]

        def _new_groups(self, rank_lists: list[list[int]], kw: dict[str, Any]) -> dist.ProcessGroup: ...

    def _make_dynamic_groups(self, min_size: int, kw: dict[str, Any]) -> dict[int, dist.ProcessGroup]:
        """This rank's group of every size ``c`` that dynamic CP may choose (:func:`dynamic_group_sizes`):
        the pool of each TP rank set is its ``(dp, sp)`` grid flattened row-major (position
        ``dp_rank * sp + sp_rank``), and group ``(c, i)`` is positions ``[i c, (i + 1) c)``. Sizes ascending,
        each family (every TP rank set's groups of that size) created whole, the same list on every rank:
        ``new_group``'s rule. Sizes whose groups are already made are reused: 1 is this rank alone, a
        size equal to ``sp`` is the SP group (rows of the grid), the whole pool is the SP-DP group."""
        pool = self.dp_size * self.sp_size
        pools = self.cube.permute(2, 0, 1).reshape(self.tp_size, pool)  # (tp, pool): every TP rank set's pool
        made: dict[int, dist.ProcessGroup] = {}
        for c in dynamic_group_sizes(pool, min_size):
            if c == 1:
                made[c] = self.self_group
            elif c == pool:
                made[c] = self.sp_dp_group
            elif c == self.sp_size:
                made[c] = self.sp_group
            else:
                made[c] = self._new_groups(pools.reshape(-1, c).tolist(), kw)
        return made

    @property
    def pool_size(self) -> int:
        """Ranks in the dynamic-CP pool: the DP x SP ranks of one TP rank set (``dp_size * sp_size``)."""
        return self.dp_size * self.sp_size

    @property
    def pool_position(self) -> int:
        """This rank's position in its pool: ``dp_rank * sp_size + sp_rank``."""
        return self.dp_rank * self.sp_size + self.sp_rank

    @property
    def dynamic_sizes(self) -> tuple[int, ...]:
        """The group sizes made for dynamic CP, ascending (empty without ``sequence_parallel.dynamic``)."""
        return tuple(self._dynamic_groups)

    def is_dynamic_group(self, group: dist.ProcessGroup | None) -> bool:
        """``group`` is one of this rank's dynamic-CP groups (of any size, the one-rank group included)."""
        return group is not None and any(group is g for g in self._dynamic_groups.values())

    def dynamic_group(self, size: int, index: int) -> dist.ProcessGroup:
        """Dynamic CP's group ``(size, index)``: pool positions ``[index * size, (index + 1) * size)`` of
        this rank's TP rank set (made at creation; no collective here). A rank holds only the groups it
        is in, which are the only ones a plan hands it.

        Raises:
            ValueError: no groups of that size were made, or this rank is not in group ``index``.
        """
        if size not in self._dynamic_groups:
            raise ValueError(
                f"dynamic_group: no dynamic-CP groups of size {size} (made: {list(self._dynamic_groups) or 'none'}); "
                "set sequence_parallel.dynamic in the config passed to init_process_groups, and plan with the "
                "same min_size"
            )
        if self.pool_position // size != index:
            raise ValueError(
                f"dynamic_group: rank {self.rank} (pool position {self.pool_position}) is not in group ({size}, "
                f"{index}), positions {index * size}..{(index + 1) * size - 1}; its group of that size is index "
                f"{self.pool_position // size}"
            )
        return self._dynamic_groups[size]

    def dynamic_ranks(self, size: int, index: int) -> list[int]:
        """Global ranks of dynamic group ``(size, index)`` of this rank's TP rank set, in position order."""
        return self.grid.flatten()[index * size:(index + 1) * size].tolist()
