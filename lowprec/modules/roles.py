"""The quantizer roles of a GEMM module (``LowprecModule``'s share of them): each GEMM's
name, its boundary roles, and the role of every forward and backward quantizer slot, kept
from construction and from each change of the attributes they are built from."""

from __future__ import annotations

from ..recipe import check_num_quantizers, gemm_roles

#: Attributes the roles are built from (``get_quantizer_roles``)
_ROLE_ATTRS = frozenset({"name", "output_quantizer_role", "grad_input_quantizer_role"})


class RolesMixin:
    """The role methods of ``LowprecModule`` (which holds ``name``, ``module_type`` and the
    boundary roles ``output_quantizer_role`` and ``grad_input_quantizer_role``)."""

    def _gemm_names(self) -> list[str]:
        """Name of each GEMM (its roles' ``name``); one GEMM named after the module by default."""
        return [self.name]

    def _boundary(self, i: int, fwd: bool):
        """The boundary role of GEMM i's output (fwd) or grad-input (bwd) slot, or None."""
        n = len(self._gemm_names())
        if fwd:
            return self.output_quantizer_role if i == n - 1 else None
        return self.grad_input_quantizer_role if i == 0 else None

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int | None = None) -> list:
        """Roles of every quantizer slot: forward [input, weight, output] per GEMM,
        backward [grad_output, grad_input] per GEMM."""
        roles = []
        for i, gname in enumerate(self._gemm_names()):
            boundary = self._boundary(i, fwd)
            roles += gemm_roles(self.module_type, gname, fwd=fwd,
                                output_role=boundary if fwd else None,
                                grad_input_role=None if fwd else boundary)
        return check_num_quantizers(self, fwd, num_quantizers, roles)

    def _roles(self) -> tuple[list, list]:
        """The (forward, backward) roles, kept from construction and from each change of
        the attributes they are built from (reading them costs a compiled call no guard
        on those attributes)."""
        roles = self.__dict__.get("_role_lists")
        if roles is None:
            roles = self._cache_roles()
        return roles

    def _cache_roles(self) -> tuple[list, list]:
        roles = self.__dict__["_role_lists"] = (self.get_quantizer_roles(fwd=True),
                                                self.get_quantizer_roles(fwd=False))
        return roles
