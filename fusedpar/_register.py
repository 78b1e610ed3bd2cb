"""Registers the backends that ship with the package (kernel packages add their own)."""

from . import _backends, _reference, _ring

_backends.register(_backends.Backend(
    _backends.REFERENCE, run=_reference.run, unavailable=lambda call: None,
    description="the pure-lax expression: all_gather then dot; dot then psum_scatter"))
_backends.register(_backends.Backend(
    _backends.RING, run=_ring.run, unavailable=lambda call: None,
    description="ppermute ring schedules in lax, uni- or bidirectional, unrolled or rolled",
    options=lambda: frozenset({"no_transfers"})))
from . import _pallas as _pallas
