"""Phase timing of decode cycles (a leaf package: anything may import it)."""

from specscope.profiler.phases import Phase, PhaseTimer

__all__ = ["Phase", "PhaseTimer"]
