"""Phase timing of decode cycles (a leaf package: anything may import it)."""

from specscope.profiler.phases import Phase
from specscope.profiler.profiler import Profiler, format_summary
from specscope.profiler.report import write_report
from specscope.profiler.trace import CycleRecord, chrome_trace, write_chrome_trace

__all__ = ["CycleRecord", "Phase", "Profiler", "chrome_trace", "format_summary",
           "write_chrome_trace", "write_report"]
