"""A static HTML site of the bench results (`islands report`): docs/report.md.

from islands.report import build_site
build_site("results", "site")   # then open site/index.html
"""

from islands.report.cli import add_report_command
from islands.report.results import ReportError
from islands.report.site import build_site

__all__ = ["ReportError", "add_report_command", "build_site"]
