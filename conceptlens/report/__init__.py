"""Static HTML report of a run folder (concepts/ + describe/): `write_report(run)`.

    from conceptlens.report import write_report
    write_report("runs/demo").path          # runs/demo/report/index.html, opens from file://
"""

from conceptlens.report.atlas import Atlas, ExtractorView
from conceptlens.report.build import ReportSummary, write_report

__all__ = ["Atlas", "ExtractorView", "ReportSummary", "write_report"]
